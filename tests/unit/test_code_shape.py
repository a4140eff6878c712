"""A reader can hold a function in their head: none is longer than MAX_LINES unless its
body says why, in a comment that starts with `# Long:`. A reader can find a module: no
package holds more than MAX_MODULES at one level. A runtime hook of the step is written
once: every stepper is built from the one step context, which alone applies the hooks."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("core", "dataprep", "launcher", "models", "parallel", "trainer")
ROOTS = (*PRODUCT, "bench", "tests")
MAX_LINES = 80
MAX_MODULES = 15
"""Modules (besides `__init__` and `__main__`) one package may hold at one level; past it a
stage or component becomes a sub-package."""
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


def crowded_packages(root: Path) -> list[str]:
    """`package (N modules)` of every product package with more than MAX_MODULES."""
    found = []
    for top in PRODUCT:
        for init in sorted((root / top).rglob("__init__.py")):
            modules = [
                p for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__")
            ]
            if len(modules) > MAX_MODULES:
                found.append(f"{init.parent.relative_to(root)} ({len(modules)} modules)")
    return found


def test_no_package_holds_more_than_max_modules_at_one_level() -> None:
    assert crowded_packages(REPO) == []


def test_a_crowded_package_is_found(tmp_path: Path) -> None:
    package = tmp_path / "trainer" / "step"
    package.mkdir(parents=True)
    for name in ("__init__", *(f"m{i}" for i in range(MAX_MODULES + 1))):
        (package / f"{name}.py").write_text("")
    (tmp_path / "trainer" / "__init__.py").write_text("")
    assert crowded_packages(tmp_path) == [f"trainer/step ({MAX_MODULES + 1} modules)"]


STEP_HOOKS = ("vocab_parallel_loss(", "forward_context(", "document_ids(", ".shard(")
"""What every step applies around its forward and loss: the step context's to apply."""


def test_every_stepper_takes_the_one_step_context_and_only_it_applies_the_hooks() -> None:
    import inspect

    from pretrain.trainer.step.context import StepContext
    from pretrain.trainer.step.local import LocalStep
    from pretrain.trainer.step.pipedream import PipeDreamStep
    from pretrain.trainer.step.pipeline import PipelineStep

    for stepper in (LocalStep, PipelineStep, PipeDreamStep):
        parameters = list(inspect.signature(stepper).parameters.values())
        assert [p.annotation for p in parameters] in (["StepContext"], [StepContext]), stepper
    for path in sorted((REPO / "trainer" / "step").glob("*.py")):
        if path.name in ("context.py", "state.py"):
            continue
        text = path.read_text()
        assert [hook for hook in STEP_HOOKS if hook in text] == [], path.name
