"""Start a written run dir: torchrun in the foreground (local) or sbatch (SLURM)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.job import JobFiles, job_env, torchrun_args
from pretrain_core.rundir import LOGS_DIR
from pretrain_core.schema import RecipeConfig

FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
"""SLURM job states after which the job will not run again by itself."""

_SUBMIT_TIMEOUT_S = 120

NEVER_STARTS = {
    "PartitionConfig": "it asks for more than any node of the partition has (CPUs, GPUs or "
    "memory per node); lower cluster.cpus_per_task or cluster.gpus_per_node, or pick "
    "another cluster.partition",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows; lower "
    "cluster.nodes or pick another cluster.partition",
    "PartitionTimeLimit": "its time limit is over the partition's; lower cluster.time",
    "BadConstraints": "no node can satisfy what it asks for; check cluster.gpus_per_node and "
    "cluster.cpus_per_task against the nodes (sinfo -N -l)",
    "InvalidAccount": "the account is not valid here; fix cluster.account",
    "InvalidQOS": "the quality of service is not valid here; fix cluster.qos",
}
"""Reasons a pending job gives when it will never start as submitted, and what to change."""


class LaunchError(RuntimeError):
    """A job could not be started or followed; the message says why and what to do."""


@dataclass(frozen=True)
class SubmittedJob:
    """A job that SLURM accepted: its id and the log file it will write."""

    job_id: str
    log_path: Path


def run_local(files: JobFiles, cfg: RecipeConfig) -> int:
    """Run torchrun for this run dir in the foreground and return its exit code.

    Output goes straight to this console. The child runs in its own process group and
    Ctrl-C / SIGTERM are forwarded to the whole group, so torchrun can stop its workers
    cleanly. A child killed by signal N returns 128 + N, as a shell would report it.
    """
    args = torchrun_args(cfg, files.config_path)
    if shutil.which(args[0]) is None:
        raise LaunchError(f"{args[0]} is not on PATH: install torch in this environment")
    env = {**os.environ, **job_env(cfg)}
    proc = subprocess.Popen(args, env=env, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    forwarded = (signal.SIGINT, signal.SIGTERM)
    # Signal handlers can only be installed from the main thread.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in forwarded} if in_main else {}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def submit_slurm(files: JobFiles) -> SubmittedJob:
    """Submit the run dir's job.sbatch with sbatch; the job starts in the current directory."""
    command = ["sbatch", "--parsable", str(files.script_path)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_SUBMIT_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise LaunchError(
            "sbatch is not on PATH: cluster.backend=slurm submits from a SLURM login node; "
            "use cluster=local to run on this machine"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"sbatch did not answer in {_SUBMIT_TIMEOUT_S} s: is the SLURM controller up?"
        ) from None
    if result.returncode != 0:
        raise LaunchError(
            f"sbatch rejected {files.script_path} (exit {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    # --parsable prints "ID" or "ID;CLUSTER".
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"sbatch printed no job id: {result.stdout.strip()!r}")
    return SubmittedJob(job_id=job_id, log_path=files.run_dir / LOGS_DIR / f"slurm-{job_id}.out")


def slurm_job_state(job_id: str) -> str:
    """The job's current state as `scontrol show job` reports it (e.g. PENDING, COMPLETED)."""
    return _show_job(job_id)["JobState"]


def never_starts(job_id: str) -> str | None:
    """Why the job will never start as submitted (a pending reason of NEVER_STARTS, with the
    fix), or None while it runs, ran or may still start."""
    return _never_starts(job_id, _show_job(job_id))


def _never_starts(job_id: str, fields: dict[str, str]) -> str | None:
    reason = fields.get("Reason", "")
    if fields["JobState"] != "PENDING" or reason not in NEVER_STARTS:
        return None
    return (
        f"SLURM job {job_id} cannot start (Reason={reason}): {NEVER_STARTS[reason]}; "
        f"cancel it with `scancel {job_id}`"
    )


def _show_job(job_id: str) -> dict[str, str]:
    """The job's JobState and Reason as `scontrol show job` reports them."""
    try:
        result = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job_id],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise LaunchError("scontrol is not on PATH: no SLURM client tools here") from None
    fields = dict(re.findall(r"\b(JobState|Reason)=(\S+)", result.stdout))
    if result.returncode != 0 or "JobState" not in fields:
        raise LaunchError(
            f"scontrol show job {job_id} failed: {result.stderr.strip() or result.stdout.strip()}"
        )
    return fields


def wait_for_slurm_job(job_id: str, timeout_s: float) -> str:
    """Poll the job every second until it reaches a final state, and return that state.

    Raises LaunchError if it is still pending or running after `timeout_s` seconds, or as
    soon as it pends for a reason that means it will never start (see `never_starts`).
    (`sbatch --wait` polls at 2, 8, 32 s, which is too coarse for short jobs.)
    """
    deadline = time.monotonic() + timeout_s
    while True:
        fields = _show_job(job_id)
        state = fields["JobState"]
        if state in FINAL_STATES:
            return state
        problem = _never_starts(job_id, fields)
        if problem:
            raise LaunchError(problem)
        if time.monotonic() >= deadline:
            raise LaunchError(f"job {job_id} is still {state} after {timeout_s:g} s")
        time.sleep(1.0)
