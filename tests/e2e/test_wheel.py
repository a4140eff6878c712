"""The project as a pip user gets it: a wheel installed into a fresh venv outside the repo,
run through its console script from another directory, with the venv not activated and no
torchrun on PATH. (The venv sees the system's torch, so nothing is downloaded.)"""

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

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "launcher", "models", "parallel",
           "pretrain_core", "pretrain_data", "trainer", "recipes", "slurm")  # fmt: skip
"""What the wheel is built from (copied, so the build leaves nothing in the checkout)."""


def _build_and_install(tmp: Path) -> Path:
    """A wheel of this checkout installed into a new venv; the venv's bin directory."""
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
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    install = ["install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)]
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *install], check=True)
    return venv / "bin"


def test_an_installed_wheel_plans_scripts_and_trains_from_another_directory(
    tmp_path: Path,
) -> None:
    bin_dir = _build_and_install(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Not activated: no venv on PATH, no PYTHONPATH pointing back at the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1")
    assert shutil.which("torchrun", path=env["PATH"]) is None

    def pretrain(*args: str) -> subprocess.CompletedProcess:
        command = [str(bin_dir / "pretrain"), *args]
        return subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import launcher.assets as a; print(a.SHIPPED_RECIPES)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(tmp_path / "venv"), where

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
