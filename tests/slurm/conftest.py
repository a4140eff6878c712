"""Fixtures of the SLURM tests: a real controller (slurm/local-cluster/start.sh on this
machine, or the cluster that SLURM_CONF already names), the CPU recipe its jobs run, and
its data, prepared by a CPU-only SLURM job of its own as `action=prepare` submits it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.backends import wait_for_slurm_job
from launcher.prepare_job import submit_prepare, write_prepare_files
from pretrain_core.data_checks import unprepared
from pretrain_core.schema import RecipeConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPTS = REPO / "slurm" / "local-cluster"
JOB_TIMEOUT_S = 300


def _controller_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    """A running controller with SLURM_CONF exported; stopped afterwards only if started here."""
    if os.environ.get("SLURM_CONF") and _controller_answers():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (munged, slurmctld and slurmd run as root)")
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed (slurm/local-cluster/start.sh installs them)"
        )
    # start.sh's default state dir (fixed, not under the TMPDIR the tests set), so that a
    # cluster started by hand or by CI is reused rather than a second one fighting for ports.
    state_dir = Path(os.environ.get("PRETRAIN_SLURM_DIR", "/tmp/pretrain-slurm"))
    previous_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state_dir / "slurm.conf")
    already_up = (state_dir / "slurm.conf").exists() and _controller_answers()
    subprocess.run([CLUSTER_SCRIPTS / "start.sh", state_dir], check=True, timeout=300)
    try:
        yield
    finally:
        if not already_up:
            subprocess.run([CLUSTER_SCRIPTS / "stop.sh", state_dir], check=False, timeout=60)
        if previous_conf is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = previous_conf


def cpu_recipe(run_dir: Path, steps: int) -> RecipeConfig:
    """The tiny default model and data on 2 CPU ranks, sized for the 2-core node."""
    cfg = RecipeConfig()
    cfg.data.max_bytes, cfg.data.val_fraction = 4_000_000, 0.02  # the tiny recipe's data
    cfg.data.cache_dir = os.environ.get("PRETRAIN_CACHE_DIR", cfg.data.cache_dir)
    cfg.cluster.backend = "slurm"
    cfg.cluster.device = "cpu"
    cfg.cluster.gpu_type = "cpu"
    cfg.cluster.gpus_per_node = 2
    cfg.cluster.cpus_per_task = 1
    cfg.train.steps = steps
    cfg.logging.log_every = 1
    cfg.logging.wandb = "disabled"
    cfg.run.dir = str(run_dir)
    return cfg


def prepare_on_slurm(cfg: RecipeConfig) -> None:
    """Prepare the recipe's data with the CPU-only job `action=prepare` submits (in
    RUN_DIR), unless it is prepared already."""
    if not unprepared(cfg):
        return
    job = submit_prepare(write_prepare_files(cfg, Path(cfg.run.dir)))
    state = wait_for_slurm_job(job.job_id, JOB_TIMEOUT_S)
    assert state == "COMPLETED", job.log_path.read_text()
    assert not unprepared(cfg)


@pytest.fixture(scope="module")
def tiny_data(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The data of cpu_recipe and of the tiny recipe (the same dataset), prepared."""
    prepare_on_slurm(cpu_recipe(tmp_path_factory.mktemp("prepare"), steps=1))
