"""A reader can hold a function in their head: none is longer than MAX_LINES unless its
body says why, in a comment that starts with `# Long:`."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("pretrain_core", "launcher", "models", "parallel", "trainer", "bench", "tests")
MAX_LINES = 80
REASON = "# Long:"


def long_functions(root: Path) -> list[str]:
    """`path:line name (N lines)` of every function over MAX_LINES without a reason."""
    found = []
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                length = node.end_lineno - node.lineno + 1
                body = lines[node.lineno - 1 : node.end_lineno]
                if length > MAX_LINES and not any(REASON in line for line in body):
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({length} lines)")
    return found


def test_no_function_is_long_without_a_reason() -> None:
    assert long_functions(REPO) == []


def test_a_long_function_is_found_and_a_reason_excuses_it(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "trainer" / "a.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "trainer" / "b.py").write_text(f"def g():\n    {REASON} a table\n{body}\n")
    assert long_functions(tmp_path) == [f"trainer/a.py:1 f ({MAX_LINES + 1} lines)"]
