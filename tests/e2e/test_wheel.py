"""The project as a pip user gets it: a wheel installed into a fresh venv outside the repo,
run through its console script from another directory, with the venv not activated and no
torchrun on PATH. The venv borrows nothing from the interpreter that runs the tests (no
system site-packages, no PYTHONPATH): pip installs the CPU build of torch into it first, as
CONTRIBUTING.md's set-up does (an unpinned torch would pull a CUDA build of several GB),
then the wheel with every dependency it declares, from the package index. It is built once
per test session (about a minute on 2 cores, nearly all of it pip)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.distributed.harness import BASE_OVERRIDES, read_curve
from tests.helpers import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "pretrain", "launcher", "models", "parallel",
           "core", "dataprep", "trainer", "recipes", "slurm")  # fmt: skip
"""What the wheel is built from (copied, so the build leaves nothing in the checkout)."""


TORCH = "torch==2.13.0"
"""The torch pip installs first: the CPU wheel, which satisfies the project's `torch>=`."""


def _clean_env() -> dict[str, str]:
    """This environment without what would point a venv back at the checkout or this one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="session")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout installed with its dependencies into a new venv; the venv's
    bin directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    wheels = tmp / "wheels"
    pip_wheel = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "."]
    subprocess.run([sys.executable, "-m", "pip", *pip_wheel], cwd=source, check=True)
    [wheel] = wheels.glob("pretrain-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env())
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True, env=_clean_env(), cwd=tmp)
    subprocess.run([*pip, str(wheel)], check=True, env=_clean_env(), cwd=tmp)
    subprocess.run([*pip, str(_shadowing_wheel(tmp))], check=True, env=_clean_env(), cwd=tmp)
    return venv / "bin"


SHADOWED = ("models", "trainer", "parallel", "launcher", "core")
"""Top-level names a user's project or another distribution may well use."""


def _shadow(root: Path) -> None:
    """Packages named as our sub-packages under `root`, each failing loudly when imported."""
    for name in SHADOWED:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name}')\n")


def _shadowing_wheel(tmp: Path) -> Path:
    """A wheel of another distribution whose top-level packages are named like ours."""
    source = tmp / "shadowing"
    _shadow(source)
    (source / "pyproject.toml").write_text(
        '[project]\nname = "user-models"\nversion = "1.0"\n'
        f"[tool.setuptools]\npackages = {list(SHADOWED)}\n"
    )
    out = tmp / "shadowing-wheel"
    pip_wheel = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."]
    subprocess.run([sys.executable, "-m", "pip", *pip_wheel], cwd=source, check=True)
    return next(out.glob("user_models-*.whl"))


def test_an_installed_wheel_plans_scripts_and_trains_from_another_directory(
    venv_bin: Path, tmp_path: Path
) -> None:
    bin_dir = venv_bin
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The user's own folders in the working directory, and another installed distribution
    # (in the venv), named like our sub-packages: neither may stand in for ours.
    _shadow(elsewhere)
    # Not activated: no venv on PATH, no PYTHONPATH pointing back at the checkout.
    env = _clean_env()
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1")
    assert shutil.which("torchrun", path=env["PATH"]) is None

    def pretrain(*args: str) -> subprocess.CompletedProcess:
        command = [str(bin_dir / "pretrain"), *args]
        return subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    # The project, its recipes and torch all come from the venv.
    imports = (
        "import torch, pretrain.launcher.assets as a; print(torch.__file__); "
        "print(a.SHIPPED_RECIPES)"
    )
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", imports],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(where) == 2 and all(Path(w).is_relative_to(bin_dir.parent) for w in where), where
    top_level = (
        "from importlib.metadata import distribution as d; "
        "print(d('pretrain').read_text('top_level.txt'))"
    )
    names = subprocess.run([str(bin_dir / "python"), "-c", top_level], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert names == ["pretrain"]  # the only top-level name the wheel installs

    plan = pretrain("--config-name", "llama3_8b", "action=plan")
    assert plan.returncode == 0, plan.stderr
    assert "llama3_8b" in plan.stdout

    script_dir = tmp_path / "script"
    script = pretrain("action=script", "cluster=slurm", f"run.dir={script_dir}")
    assert script.returncode == 0, script.stderr
    sbatch = (script_dir / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in sbatch
    assert str(bin_dir / "python") in sbatch  # the venv's Python runs torchrun on each node

    run_dir = tmp_path / "run"
    shrunk = [o for o in BASE_OVERRIDES if not o.startswith(("train.steps", "eval.every"))]
    run = pretrain("--config-name", "tiny", *shrunk, "train.steps=2", "eval.every=2",
                   "cluster.gpus_per_node=1", f"run.dir={run_dir}")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    curve = read_curve(run_dir / "metrics.jsonl")
    assert len(curve.loss) == 2 and len(curve.val_loss) == 1
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["steps"] == 2
