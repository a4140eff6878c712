"""Submission to a real SLURM controller: slurm/local-cluster/start.sh on this machine, or
the cluster that SLURM_CONF already names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.core.schema import dump_config, load_config
from pretrain.launcher.job.backends import LaunchError, submit_slurm, wait_for_slurm_job
from pretrain.launcher.job.run_dir import JobFiles, write_run_dir
from tests.slurm.conftest import JOB_TIMEOUT_S, REPO, cpu_recipe

pytestmark = pytest.mark.slurm


def test_a_submitted_job_runs_to_completed(slurm_cluster: None, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={tmp_path}/logs/slurm-%j.out\n"
        "#SBATCH --cpus-per-task=1\n"
        'echo "hello from $SLURM_JOB_ID"\n'
    )
    (tmp_path / "logs").mkdir()
    files = JobFiles(run_dir=tmp_path, config_path=tmp_path / "config.yaml", script_path=script)
    start = time.monotonic()
    job = submit_slurm(files)
    state = wait_for_slurm_job(job.job_id, JOB_TIMEOUT_S)
    print(f"trivial job {job.job_id}: {state} after {time.monotonic() - start:.1f} s")
    assert state == "COMPLETED"
    assert job.log_path == tmp_path / "logs" / f"slurm-{job.job_id}.out"
    assert job.log_path.read_text() == f"hello from {job.job_id}\n"


def test_a_rejected_submission_raises_with_sbatch_message(
    slurm_cluster: None, tmp_path: Path
) -> None:
    cfg = cpu_recipe(tmp_path / "run", steps=1)
    cfg.cluster.partition = "no_such_partition"
    files = write_run_dir(cfg, Path(cfg.run.dir), dump_config(cfg))
    with pytest.raises(
        LaunchError, match=r"sbatch rejected .*invalid partition specified: no_such_partition"
    ):
        submit_slurm(files)


def test_a_rendered_job_trains_in_a_run_dir_named_like_shell_code(
    tiny_data: None, tmp_path: Path
) -> None:
    marker = tmp_path / "owned"
    run_dir = tmp_path / f"run $(touch {marker}); touch {marker} 'q\" %j"
    cfg = cpu_recipe(run_dir, steps=2)
    cfg.name = f"tiny`touch {marker}`"
    cfg.cluster.env = {"PRETRAIN_PROBE": f"$(touch {marker})"}
    files = write_run_dir(cfg, run_dir, dump_config(cfg))
    job = submit_slurm(files)
    state = wait_for_slurm_job(job.job_id, JOB_TIMEOUT_S)
    log = job.log_path.read_text()
    assert state == "COMPLETED", log
    assert f"config: {files.config_path}\n" in log
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == cfg.train.steps
    assert not marker.exists()


def _pretrain(args: list[str], cwd: Path) -> str:
    """Run the `pretrain` CLI (as its console script would) and return its output."""
    if (
        not (REPO / "launcher" / "cli.py").exists()
        or not (REPO / "trainer" / "__main__.py").exists()
    ):
        pytest.skip("launcher/cli.py or trainer/__main__.py does not exist yet")
    pretrain = shutil.which("pretrain")
    command = [pretrain] if pretrain else [sys.executable, "-m", "pretrain"]
    result = subprocess.run(
        [*command, *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# The tiny recipe on the 2-core test node: 2 CPU ranks in one task of 1 allocated CPU.
SLURM_TINY = [
    "--config-name", "tiny", "cluster=slurm", "cluster.device=cpu", "cluster.gpu_type=cpu",
    "cluster.gpus_per_node=2", "cluster.cpus_per_task=1", "cluster.omp_num_threads=1",
    "schedule.warmup_steps=0", "logging.log_every=1", "logging.wandb=disabled",
]  # fmt: skip


def _submitted_logs(output: str) -> list[Path]:
    return [Path(p) for p in re.findall(r"log: (\S+/logs/slurm-\d+\.out)", output)]


@pytest.mark.e2e
def test_pretrain_submits_to_slurm_and_the_job_trains(tiny_data: None, tmp_path: Path) -> None:
    steps = 3
    run_dir = tmp_path / "run"
    output = _pretrain([*SLURM_TINY, f"train.steps={steps}", f"run.dir={run_dir}"], cwd=tmp_path)
    [log] = _submitted_logs(output)
    assert log.parent == run_dir / "logs"
    job_id = re.fullmatch(r"slurm-(\d+)\.out", log.name)[1]
    assert f"submitted SLURM job {job_id}" in output
    state = wait_for_slurm_job(job_id, JOB_TIMEOUT_S)
    assert state == "COMPLETED", log.read_text()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps


@pytest.mark.e2e
def test_a_pretrain_sweep_submits_one_job_per_point(tiny_data: None, tmp_path: Path) -> None:
    steps = 2
    seeds = (1, 2)
    output = _pretrain(
        ["-m", *SLURM_TINY, f"train.steps={steps}", "seed=" + ",".join(map(str, seeds))],
        cwd=tmp_path,
    )
    logs = _submitted_logs(output)
    run_dirs = {log.parent.parent for log in logs}
    assert len(logs) == len(seeds)
    assert len(run_dirs) == len(seeds)
    for log in logs:
        job_id = re.fullmatch(r"slurm-(\d+)\.out", log.name)[1]
        assert wait_for_slurm_job(job_id, JOB_TIMEOUT_S) == "COMPLETED", log.read_text()
    seeds_run = set()
    for run_dir in run_dirs:
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps
        seeds_run.add(load_config(str(run_dir / "config.yaml")).seed)
    assert seeds_run == set(seeds)


@pytest.mark.e2e
def test_a_job_no_node_can_take_is_refused_before_submission(
    slurm_cluster: None, tmp_path: Path
) -> None:
    asks = [a for a in SLURM_TINY if not a.startswith("cluster.cpus_per_task=")]
    result = subprocess.run(
        [
            sys.executable, "-m", "pretrain", *asks, "cluster.cpus_per_task=64",
            "train.steps=1", f"run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "submitted SLURM job" not in result.stdout
    assert "cluster.cpus_per_task=64: the job runs one task per node, and no node of" in (
        result.stderr
    )
    assert not (tmp_path / "run").exists()
