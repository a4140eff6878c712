"""Fixtures of the SLURM tests: a real controller (slurm/local-cluster/start.sh on this
machine with two emulated nodes, or the cluster that SLURM_CONF already names), the CPU
recipe its jobs run and its data, prepared by a CPU-only SLURM job of its own as
`action=prepare` submits it, and submission of the harness model through the `pretrain`
CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.checks import unprepared
from pretrain.launcher.job.backends import wait_for_slurm_job
from pretrain.launcher.job.prepare import submit_prepare, write_prepare_files
from tests.distributed.harness import BASE_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPTS = REPO / "slurm" / "local-cluster"
JOB_TIMEOUT_S = 300
CLUSTER_NODES = 2


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
    # Two nodes, as CI starts it; a one-node cluster is restarted once its queue is empty.
    nodes = ["--nodes", str(CLUSTER_NODES)]
    subprocess.run([CLUSTER_SCRIPTS / "start.sh", *nodes, state_dir], check=True, timeout=900)
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


@pytest.fixture(scope="module")
def harness_data(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The harness model's data, prepared here with `action=prepare` (the nodes of the local
    cluster share this machine's cache, as a cluster's nodes share a file system)."""
    run_dir = tmp_path_factory.mktemp("harness_prepare") / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "pretrain", "--config-name", "tiny", *BASE_OVERRIDES,
            "action=prepare", f"run.dir={run_dir}",
        ],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def two_nodes(slurm_cluster: None) -> None:
    """The cluster has at least two nodes that can take jobs."""
    states = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, check=True
    ).stdout.split()
    usable = [s for s in states if s.rstrip("*") in ("idle", "mix", "alloc", "comp")]
    if len(usable) < 2:
        pytest.skip(f"the SLURM cluster has {len(usable)} usable node(s); these tests need 2")


SLURM_CPU = [
    "cluster=slurm", "cluster.device=cpu", "cluster.gpu_type=cpu", "cluster.cpus_per_task=1",
    "cluster.omp_num_threads=1",
]  # fmt: skip
"""The harness model's runs as SLURM jobs on the CPU test nodes."""


def submit(run_dir: Path, overrides: list[str], cwd: Path) -> str:
    """Submit the harness model with `overrides` through the `pretrain` CLI; the job id."""
    result = subprocess.run(
        [
            sys.executable, "-m", "pretrain", "--config-name", "tiny", *BASE_OVERRIDES,
            *SLURM_CPU, f"run.dir={run_dir}", *overrides,
        ],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return re.search(r"submitted SLURM job (\d+)", result.stdout)[1]
