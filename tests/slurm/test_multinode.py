"""Jobs on two emulated nodes of the local SLURM cluster: one agent per node (torchrun in a
c10d rendezvous hosted on the first node), the harness model, FP32 on CPU.

- 2 nodes x 1 rank and 2 nodes x 2 ranks reproduce the single process within the FP32
  tolerance; a twin of the 2 x 1 job runs beside it on the same nodes, each job on a
  rendezvous port of its own, with the same curve; the 2 x 1 job also runs a cluster.setup
  line on each node before torchrun, and records each node's system metrics in W&B
  (offline): node 0's in the main run, node 1's in a run of its own in the main run's group;
- a 2 x 1 job that loses a rank (the agents of both nodes restart their ranks from the last
  checkpoint: cluster.max_restarts), is warned by SIGUSR1 (what SLURM sends before the time
  limit) and then preempted by SIGTERM, saving and requeueing itself after each signal,
  ends with the loss and gradient-norm curves of the same job run uninterrupted, bit for
  bit, in one W&B run;
- a 2 x 1 job that may shrink to one node (cluster.min_nodes=1) loses its second node (its
  slurmd and every process of the job there killed at once, as a crash would) and finishes
  on the first with the layout the launcher chose for it: the curve of the single process,
  before and after the shrink, within the FP32 tolerance (as any layout), and `pretrain
  status` tells where each part ran.

The preempted jobs run 12 steps whose learning rate decays over the reference's 8, so that
their first 8 steps are the reference's and there are steps left for three interruptions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from pretrain.core.run.goodput import breakdown
from pretrain.core.run.rundir import SLURM_JOB_FILE
from pretrain.launcher.job.backends import wait_for_slurm_job
from pretrain.trainer.observe.loggers import node_wandb_dir
from tests.distributed.harness import (
    FP32_TOLERANCE,
    Curve,
    max_relative_difference,
    read_curve,
)
from tests.helpers import finished_wandb_records
from tests.slurm.conftest import CLUSTER_NODES, CLUSTER_SCRIPTS, JOB_TIMEOUT_S, submit

pytestmark = pytest.mark.slurm

LONGER = ["train.steps=12", "schedule.decay_steps=6", "checkpoint.every=2", "checkpoint.keep=2"]
"""12 steps with the reference's schedule (2 warmup + 6 decay) over the first 8."""


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl; a step logged again after a resume counts last."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def assert_matches_reference(run_dir: Path, reference: Curve, grad_norm_tolerance: float) -> None:
    """The run's first 8 steps are the reference's within the harness's tolerances (loss and
    validation loss 1e-5, gradient norm within the session's derived `grad_norm_tolerance`)."""
    measured = read_curve(run_dir / "metrics.jsonl")
    loss = max_relative_difference(measured.loss[:8], reference.loss)
    norm = max_relative_difference(measured.grad_norm[:8], reference.grad_norm)
    evaluated = len(reference.val_loss)
    val = max_relative_difference(measured.val_loss[:evaluated], reference.val_loss)
    print(f"{run_dir.name}: loss {loss:.2e}, grad norm {norm:.2e}, val loss {val:.2e}")
    steps = "\n".join(
        f"step {i}: loss {a} vs {b}, grad norm {c} vs {d}"
        for i, (a, b, c, d) in enumerate(
            zip(
                measured.loss, reference.loss, measured.grad_norm, reference.grad_norm, strict=False
            ),
            1,
        )
    )
    assert loss <= FP32_TOLERANCE and val <= FP32_TOLERANCE, steps
    assert norm <= grad_norm_tolerance, steps


def job_field(job_id: str, name: str) -> str:
    out = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True
    ).stdout
    return out.split(f"{name}=", 1)[1].split()[0]


def wait_until(condition, what: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def logged_beyond(run_dir: Path, step: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and max(losses(run_dir), default=0) > step


def log_of(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


TWIN = "twin_2x1"
"""The run dir, beside the uninterrupted one, of the same job submitted with it."""


@pytest.fixture(scope="module")
def uninterrupted_2x1(
    two_nodes: None, harness_data: None, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The 2 x 1 job run through, and a twin of it (no W&B, no setup) submitted at the same
    time: each takes one of a node's two CPUs, so both run at once on the same nodes."""
    run_dir = tmp_path_factory.mktemp("multinode") / "uninterrupted_2x1"
    setup = f"cluster.setup=['touch {run_dir}/setup-ran-on-$SLURMD_NODENAME']"
    overrides = ["cluster.nodes=2", "cluster.gpus_per_node=1", *LONGER]
    job = submit(run_dir, [*overrides, setup, "logging.wandb=offline"], run_dir.parent)
    twin_dir = run_dir.parent / TWIN
    twin = submit(twin_dir, overrides, run_dir.parent)
    for dir_, id_ in ((run_dir, job), (twin_dir, twin)):
        assert wait_for_slurm_job(id_, JOB_TIMEOUT_S) == "COMPLETED", log_of(dir_, id_)
        assert "on node[1-2]" in log_of(dir_, id_)
    return run_dir


def test_two_nodes_of_one_rank_match_one_process(
    uninterrupted_2x1, harness_reference, grad_norm_tolerance
) -> None:
    assert_matches_reference(uninterrupted_2x1, harness_reference, grad_norm_tolerance)


def test_jobs_sharing_nodes_meet_on_ports_of_their_own_and_never_in_each_others_store(
    uninterrupted_2x1,
) -> None:
    job, twin = (
        (run_dir / SLURM_JOB_FILE).read_text().strip()
        for run_dir in (uninterrupted_2x1, uninterrupted_2x1.parent / TWIN)
    )
    times = {
        j: [datetime.fromisoformat(job_field(j, f)) for f in ("StartTime", "EndTime")]
        for j in (job, twin)
    }
    assert times[job][0] < times[twin][1] and times[twin][0] < times[job][1], times
    logs = [log_of(uninterrupted_2x1, job), log_of(uninterrupted_2x1.parent / TWIN, twin)]
    ports = {re.search(r"rendezvous [^:]+:(\d+),", log)[1] for log in logs}
    assert len(ports) == 2
    # On one port the later job's agents would join the earlier one's store, and lose it
    # when that job ends: "Connection was likely closed" in the exit barrier.
    lost = [
        line
        for log in logs
        for line in log.splitlines()
        if "DistNetworkError" in line or "Connection was likely closed" in line
    ]
    assert not lost, "\n".join(lost[:20])
    assert losses(uninterrupted_2x1.parent / TWIN) == losses(uninterrupted_2x1)


def test_the_setup_lines_run_on_every_node(uninterrupted_2x1) -> None:
    ran = sorted(path.name for path in uninterrupted_2x1.glob("setup-ran-on-*"))
    assert ran == ["setup-ran-on-node1", "setup-ran-on-node2"]


def test_every_node_records_its_system_metrics_in_the_runs_group_and_the_metrics(
    uninterrupted_2x1,
) -> None:
    [main] = (uninterrupted_2x1 / "wandb").glob("offline-run-*/run-*.wandb")
    [node] = (node_wandb_dir(uninterrupted_2x1, 1) / "wandb").glob("offline-run-*/run-*.wandb")
    runs = {}
    for name, history in (("main", main), ("node", node)):
        records = finished_wandb_records(history)
        [runs[name]] = [r.run for r in records if r.HasField("run")][:1]
        runs[name + " stats"] = {
            i.key for r in records if r.HasField("stats") for i in r.stats.item
        }
        runs[name + " history"] = any(r.HasField("history") for r in records)
    # A group of their own: the run dir's name (a multi-node run without logging.wandb_group).
    assert (runs["main"].run_group, runs["main"].job_type) == ("uninterrupted_2x1", "train")
    assert (runs["node"].display_name, runs["node"].run_group, runs["node"].job_type) == (
        f"{runs['main'].display_name}-node1", "uninterrupted_2x1", "node-system",
    )  # fmt: skip
    assert "memory_percent" in runs["main stats"] and runs["main history"]
    assert "memory_percent/l:node1" in runs["node stats"] and not runs["node history"]
    # And the trainer's own, node by node, in metrics.jsonl (every sink): both nodes' first
    # ranks sampled at the first logged step.
    first = json.loads((uninterrupted_2x1 / "metrics.jsonl").read_text().splitlines()[0])
    for node in ("node1", "node2"):
        assert 0 <= first[f"system/{node}/cpu_util"] <= 100
        assert first[f"system/{node}/mem_used_gib"] > 0


def test_two_nodes_of_two_ranks_match_one_process(
    two_nodes: None, harness_data: None, tmp_path: Path, harness_reference, grad_norm_tolerance
) -> None:
    run_dir = tmp_path / "run_2x2"
    job = submit(run_dir, ["cluster.nodes=2", "cluster.gpus_per_node=2"], tmp_path)
    assert wait_for_slurm_job(job, JOB_TIMEOUT_S) == "COMPLETED", log_of(run_dir, job)
    assert "world 4 (dp 4" in log_of(run_dir, job)
    assert_matches_reference(run_dir, harness_reference, grad_norm_tolerance)


def test_a_job_that_loses_a_rank_and_is_signalled_twice_resumes_bit_exactly(
    uninterrupted_2x1, tmp_path: Path
) -> None:
    run_dir = tmp_path / "interrupted_2x1"
    overrides = [
        "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.max_restarts=1", *LONGER,
        "logging.wandb=offline", "+cluster.env.PRETRAIN_FAULT_KILL=1:3",
        # Every step computes 0.5 s longer, so the signals below land with steps still to go
        # (a resumed job's last steps can otherwise finish before SIGTERM reaches it).
        "+cluster.env.PRETRAIN_FAULT_SLOW_RANK=0:0.5",
    ]  # fmt: skip
    job = submit(run_dir, overrides, tmp_path)
    # Rank 1 dies after step 3; both agents restart their ranks from the checkpoint of step 2.
    wait_until(lambda: logged_beyond(run_dir, 3), "training past the killed rank's step")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_until(lambda: job_field(job, "Restarts") == "1", "the requeue after SIGUSR1")
    first_stop = max(losses(run_dir))
    wait_until(lambda: logged_beyond(run_dir, first_stop), "the resumed job's first step")
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    state = wait_for_slurm_job(job, JOB_TIMEOUT_S)

    log = log_of(run_dir, job)
    assert state == "COMPLETED", log
    assert job_field(job, "Restarts") == "2"
    assert "rank 1 kills itself after step 3" in log
    assert "resumed from the checkpoint of step 2" in log
    assert f"stopped by SIGUSR1 after step {first_stop}; saved" in log
    assert "stopped by SIGTERM after step" in log
    # The run that SIGTERM stopped says so and no more (the elastic restart's run printed
    # its lost peer's errors before).
    terminated = log.split(f"job {job} (restart 1)")[1].split(f"job {job} (restart 2)")[0]
    assert "[agent] stopped by SIGTERM; the ranks saved" in terminated
    assert "Traceback" not in terminated
    assert losses(run_dir) == losses(uninterrupted_2x1)
    metrics = [run_dir / "metrics.jsonl", uninterrupted_2x1 / "metrics.jsonl"]
    assert read_curve(metrics[0]).grad_norm == read_curve(metrics[1]).grad_norm
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) >= 3  # the first job run, its elastic restart, two requeued runs
    assert all(path.name.endswith(f"-{run_id}") for path in wandb_runs)


def kill_node(node: str, job_id: str) -> None:
    """Take `node` of the local cluster away as a crash would: its slurmd and every process
    of the job on it (the tasks, their agent and ranks, the slurmstepd above them) die at
    once, so nothing there reports to the controller."""
    state_dir = Path(os.environ["SLURM_CONF"]).parent
    victims = {int((state_dir / "run" / f"slurmd-{node}.pid").read_text())}
    wanted = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_JOB_ID={job_id}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and wanted <= set((proc / "environ").read_bytes().split(b"\0")):
                victims.add(int(proc.name))
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if (Path("/proc") / str(parent) / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    victims.add(parent)
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def restore_cluster() -> None:
    """Restart the daemons that are not running and wait until every node is idle again."""
    state_dir = Path(os.environ["SLURM_CONF"]).parent
    start = [CLUSTER_SCRIPTS / "start.sh", "--nodes", str(CLUSTER_NODES), state_dir]
    deadline = time.monotonic() + 120
    while subprocess.run(start, capture_output=True, timeout=300).returncode != 0:
        assert time.monotonic() < deadline, "the lost node did not come back"


def test_a_job_that_loses_a_node_finishes_on_the_node_left_with_the_single_process_curve(
    uninterrupted_2x1, harness_reference, grad_norm_tolerance, tmp_path: Path
) -> None:
    run_dir = tmp_path / "lost_node_2x1"
    overrides = [
        "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.min_nodes=1", *LONGER,
        # Steps 0.5 s longer, so the node is lost with steps to go.
        "+cluster.env.PRETRAIN_FAULT_SLOW_RANK=0:0.5",
    ]  # fmt: skip
    job = submit(run_dir, overrides, tmp_path)
    assert (run_dir / "config-1-nodes.yaml").is_file()
    try:
        wait_until(lambda: logged_beyond(run_dir, 4), "training past step 4")
        kill_node("node2", job)
        state = wait_for_slurm_job(job, JOB_TIMEOUT_S)
    finally:
        restore_cluster()
    log = log_of(run_dir, job)
    assert state == "COMPLETED", log
    assert "lost 1 of 2 node(s); continuing on node1" in log
    assert "resumed from the checkpoint of step 4" in log
    assert job_field(job, "Restarts") == "0"  # the same allocation went on
    # Every step matches the single process, before the shrink and after it.
    assert_matches_reference(run_dir, harness_reference, grad_norm_tolerance)
    assert max(losses(run_dir)) == 12
    status = subprocess.run(
        [sys.executable, "-m", "pretrain", "status", str(run_dir)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    print(status)
    assert "node[1-2] (world 2); from step 4: node1 (world 1)" in " ".join(status.split())
    # The wall time of both attempts is accounted for, the lost node's among the failures.
    events = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    account = breakdown(events)
    assert account.attempts == 2 and account.failures_s > 0, account.line()
    assert abs(account.unaccounted_s) <= 0.02 * account.total_s, account.line()
