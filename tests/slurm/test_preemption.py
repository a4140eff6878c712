"""Preemption on a real SLURM: a job signalled with SIGUSR1 (as SLURM does before the time
limit) saves, requeues itself, resumes the same W&B run and ends with the loss curve of a
run that was never interrupted."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from launcher.backends import submit_slurm, wait_for_slurm_job
from launcher.job import write_run_dir
from pretrain_core.schema import RecipeConfig, dump_config
from tests.slurm.conftest import JOB_TIMEOUT_S, cpu_recipe

pytestmark = pytest.mark.slurm

STEPS = 60
SIGNAL_AFTER_STEP = 3


def small_recipe(run_dir: Path) -> RecipeConfig:
    """The 2-rank CPU recipe with a model small enough to train a step in a fraction of a
    second; checkpoints only when asked to stop and at the end."""
    cfg = cpu_recipe(run_dir, STEPS)
    m = cfg.model
    m.vocab_size, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim = 512, 64, 4, 2, 192
    cfg.data.max_bytes = 400_000
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 64, 2, 8
    cfg.checkpoint.every = 0
    return cfg


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def wait_for_steps(metrics: Path, steps: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert time.monotonic() < deadline, f"{metrics} has fewer than {steps} steps"
        time.sleep(0.2)


def restarts(job_id: str) -> int:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split("Restarts=", 1)[1].split()[0])


def test_a_signalled_job_saves_requeues_and_continues_the_same_curve(
    slurm_cluster: None,
    tmp_path: Path,
) -> None:
    reference_cfg = small_recipe(tmp_path / "reference")
    reference_cfg.cluster.backend = "local"
    ref = write_run_dir(reference_cfg, tmp_path / "reference", dump_config(reference_cfg))
    subprocess.run(["bash", str(ref.script_path)], check=True, capture_output=True, timeout=300)

    cfg = small_recipe(tmp_path / "run")
    cfg.logging.wandb = "offline"
    files = write_run_dir(cfg, tmp_path / "run", dump_config(cfg))
    job = submit_slurm(files)
    wait_for_steps(files.run_dir / "metrics.jsonl", SIGNAL_AFTER_STEP, JOB_TIMEOUT_S)
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True)
    state = wait_for_slurm_job(job.job_id, JOB_TIMEOUT_S)

    assert state == "COMPLETED", job.log_path.read_text()
    assert restarts(job.job_id) == 1
    assert losses(files.run_dir) == losses(ref.run_dir)
    run_id = (files.run_dir / "wandb_run_id").read_text().strip()
    wandb_runs = sorted((files.run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2
    assert all(path.name.endswith(f"-{run_id}") for path in wandb_runs)
