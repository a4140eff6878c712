"""Imports point one way and never in a circle, and always under the one name `pretrain`.

`launcher -> core, dataprep, models`; `trainer -> parallel -> models -> core`;
`trainer -> dataprep -> core`. The core, data preparation and the launcher import no torch
(the core is what a login node and the ranks share; the launcher must start in well under a
second). Every import counts, including those inside functions and under TYPE_CHECKING: a
function-level import that patches a cycle is still a cycle. A sub-package imported by its
bare folder name (`import models`) is refused too: that name is the user's, not ours.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "pretrain"
PACKAGES = ("core", "dataprep", "models", "parallel", "trainer", "launcher")
"""The sub-packages of `pretrain`, each a folder at the repository's top level."""
MAY_IMPORT = {
    "core": set(),
    "dataprep": {"core"},
    "models": {"core"},
    "parallel": {"models", "core"},
    "trainer": {"parallel", "models", "dataprep", "core"},
    "launcher": {"core", "dataprep", "models"},
}
"""The sub-packages each sub-package may import (besides itself)."""
TORCH_FREE = ("core", "dataprep", "launcher")
LAUNCHER_STAGES = ("compose", "validate", "plan", "job")
"""The launcher's stages, in the order a command runs them: a stage imports earlier stages
and the launcher's shared leaf modules (LAUNCHER_LEAVES), never a later stage or the CLI."""
LAUNCHER_LEAVES = (
    "pretrain.launcher.assets",
    "pretrain.launcher.output",
    "pretrain.launcher.tables",
)


def module_name(root: Path, path: Path) -> str:
    """`root/trainer/step/local.py` -> `pretrain.trainer.step.local`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join([NAMESPACE, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def sub_package(module: str) -> str:
    """`pretrain.trainer.step.local` -> `trainer`."""
    return module.split(".")[1]


def imported_names(path: Path) -> list[str]:
    """Every module name an import statement of `path` names, `from a import b` as a.b too."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def import_graph(
    root: Path,
) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the repo's modules it imports, module -> third-party top-level names,
    module -> our sub-packages it imports by their bare folder name)."""
    files = {module_name(root, p): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    internal: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    bare: dict[str, set[str]] = {}
    for module, path in files.items():
        internal[module], external[module], bare[module] = set(), set(), set()
        for name in imported_names(path):
            top = name.split(".")[0]
            if top in PACKAGES:
                bare[module].add(top)
                continue
            if top != NAMESPACE:
                external[module].add(top)
                continue
            # `from a.b import c`: a.b.c when c is a module, else a.b (or its nearest parent).
            while name not in files and name.count(".") > 1:
                name = name.rsplit(".", 1)[0]
            if name != module and name in files:
                internal[module].add(name)
    return internal, external, bare


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(root: Path) -> list[str]:
    """Every broken import rule of the tree under `root`, one line each."""
    internal, external, bare = import_graph(root)
    problems = []
    for module, targets in sorted(internal.items()):
        package = sub_package(module)
        for target in sorted(targets):
            other = sub_package(target)
            if other != package and other not in MAY_IMPORT[package]:
                problems.append(f"{module} imports {target}: {package} may not import {other}")
        if package in TORCH_FREE and "torch" in external[module]:
            problems.append(f"{module} imports torch: {package} must stay torch-free")
        problems += [
            f"{module} imports {name}: import it as {NAMESPACE}.{name}"
            for name in sorted(bare[module])
        ]
    problems += _stage_violations(internal)
    problems += [f"import cycle: {' <-> '.join(group)}" for group in cycles(internal)]
    return problems


def _stage(module: str) -> int | None:
    """The index of the launcher stage `module` belongs to; None outside the stages."""
    parts = module.split(".")
    if parts[1] == "launcher" and len(parts) > 2 and parts[2] in LAUNCHER_STAGES:
        return LAUNCHER_STAGES.index(parts[2])
    return None


def _stage_violations(internal: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(internal.items()):
        stage = _stage(module)
        if stage is None:
            continue
        for target in sorted(targets):
            if sub_package(target) != "launcher" or target in LAUNCHER_LEAVES:
                continue
            other = _stage(target)
            if other is None or other > stage:
                where = "the CLI" if other is None else f"the later stage {LAUNCHER_STAGES[other]}"
                problems.append(
                    f"{module} imports {target}: a launcher stage may not import {where}"
                )
    return problems


def test_the_repo_keeps_every_import_rule() -> None:
    assert violations(REPO) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"trainer/loop.py": "from pretrain.launcher.cli import main\n"},
            "pretrain.trainer.loop imports pretrain.launcher: trainer may not import launcher",
        ),
        (
            {
                "parallel/tp.py": "def f():\n    import pretrain.trainer.loop\n",
                "trainer/loop.py": "",
            },
            "pretrain.parallel.tp imports pretrain.trainer.loop: parallel may not import trainer",
        ),
        (
            {"core/schema.py": "import torch\n"},
            "pretrain.core.schema imports torch: core must stay torch-free",
        ),
        (
            {"core/schema.py": "from pretrain.models.llama import X\n", "models/llama.py": ""},
            "pretrain.core.schema imports pretrain.models.llama: core may not import models",
        ),
        (
            {
                "models/llama.py": "from pretrain.models.moe import MoE\n",
                "models/moe.py": "def f():\n    from pretrain.models.llama import FeedForward\n",
            },
            "import cycle: pretrain.models.llama <-> pretrain.models.moe",
        ),
        (
            {
                "launcher/validate/__init__.py": "",
                "launcher/validate/job.py": "from pretrain.launcher.job.run_dir import render\n",
                "launcher/job/__init__.py": "",
                "launcher/job/run_dir.py": "",
            },
            "pretrain.launcher.validate.job imports pretrain.launcher.job.run_dir: "
            "a launcher stage may not import the later stage job",
        ),
        (
            {
                "launcher/plan/__init__.py": "",
                "launcher/plan/cost.py": "import pretrain.launcher.cli\n",
                "launcher/cli.py": "",
            },
            "pretrain.launcher.plan.cost imports pretrain.launcher.cli: "
            "a launcher stage may not import the CLI",
        ),
        (
            {"dataprep/prepare.py": "from pretrain.trainer.loop import x\n", "trainer/loop.py": ""},
            "pretrain.dataprep.prepare imports pretrain.trainer.loop: "
            "dataprep may not import trainer",
        ),
        (
            {"trainer/build.py": "import models\n"},
            "pretrain.trainer.build imports models: import it as pretrain.models",
        ),
    ],
    ids=[
        "trainer-to-launcher",
        "function-level",
        "torch-in-core",
        "core-to-models",
        "cycle",
        "later-stage",
        "stage-to-cli",
        "data-to-trainer",
        "bare-folder-name",
    ],
)
def test_a_bad_import_is_reported(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    assert violations(_tree(tmp_path, files)) == [expected]


def unlisted_packages(root: Path) -> list[str]:
    """The folders of `pretrain` that the wheel would leave out: packages (an `__init__.py`)
    missing from pyproject.toml's explicit `packages` list."""
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = []
    for top in PACKAGES:
        for init in sorted((root / top).rglob("__init__.py")):
            name = ".".join((NAMESPACE, *init.parent.relative_to(root).parts))
            if name not in listed:
                found.append(name)
    return found


def test_the_wheel_lists_every_package() -> None:
    assert unlisted_packages(REPO) == []


def test_a_package_left_out_of_the_wheel_is_named(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackages = ["pretrain.core"]\n')
    for folder in ("core", "core/run"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    assert unlisted_packages(tmp_path) == ["pretrain.core.run"]
