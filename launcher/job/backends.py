"""Start a written run dir: torchrun in the foreground (local) or sbatch (SLURM).

A local run owns its run dir (the lock, `claimed_run_dir`) and its processes: torchrun (or,
for a single rank, the rank itself: `pretrain.launcher.job.run_dir.local_command`) dies with the
launcher (a
parent-death signal, and every rank asks for the same from its parent), Ctrl-C, SIGTERM
and a closed terminal are forwarded to it, and its stderr is kept in
RUN_DIR/logs/torchrun.log. Once a rank has reported a failure (or the run is being
stopped) the rest of that stderr goes to the log only: the launcher prints the summary.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pretrain.core.run import run_lock
from pretrain.core.run.lifeline import child_dies_with_us
from pretrain.core.run.run_lock import SLURM_FINAL_STATES
from pretrain.core.run.rundir import LAUNCH_LOG, LOGS_DIR, SLURM_JOB_FILE
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.job.failure_summary import clear_failures, has_failures
from pretrain.launcher.job.run_dir import JobFiles, job_env, local_command
from pretrain.launcher.output import get_logger

LOG = get_logger(__name__)

KILL_MARGIN_S = 10.0
"""How long past `cluster.signal_seconds` a stopped local run may take before it is killed:
the agent's own shutdown timeout comes first."""
FINAL_STATES = SLURM_FINAL_STATES
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


@contextlib.contextmanager
def claimed_run_dir(cfg: RecipeConfig) -> Iterator[str | None]:
    """The run dir for this action: a local run takes its lock (creating the run dir) and
    yields the token the ranks inherit; a script or a SLURM submission only checks that no
    live trainer holds it (rank 0 of the job takes the lock). Nothing is written before a
    refusal, which is a LaunchError naming the holder."""
    run_dir = Path(cfg.run.dir)
    try:
        if cfg.action != "run" or cfg.cluster.backend != "local":
            run_lock.check_free(run_dir)
            yield None
            return
        created = not run_dir.exists()
        holder = run_lock.LockHolder.this_process()
        _, note = run_lock.acquire(run_dir, holder)
    except run_lock.RunDirInUse as err:
        raise LaunchError(str(err)) from None
    except OSError as err:
        raise LaunchError(f"cannot write the run dir {run_dir}: {err.strerror or err}") from None
    if note:
        LOG.warning(f"run dir {run_dir}: {note}")
    try:
        yield holder.token
    except BaseException:
        run_lock.release(run_dir, holder.token)
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # ours and left empty: as if nothing had happened
        raise
    run_lock.release(run_dir, holder.token)


class _LaunchLog:
    """The launch log, written while its file system allows: a full disk ends the log (said
    once), never the run, its console output or the failure summary after it."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[bytes] | None = None
        try:
            self._file = path.open("ab", buffering=0)
        except OSError as err:
            self._stop(err)

    def write(self, data: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(data)
        except OSError as err:
            self._stop(err)

    def _stop(self, err: OSError) -> None:
        LOG.warning(f"{self._path}: the launch log stops here: {err.strerror or err}")
        self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class _StderrTee:
    """Copies a child's stderr to a log file and, until the run turns quiet (a rank reported
    a failure, or we are stopping it), to our stderr."""

    def __init__(self, source: IO[bytes], log: _LaunchLog, quiet: threading.Event, run_dir: Path):
        self._source, self._log, self._quiet, self._run_dir = source, log, quiet, run_dir
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        for line in iter(self._source.readline, b""):
            self._log.write(line)
            if not self._quiet.is_set() and has_failures(self._run_dir):
                self._quiet.set()
            if not self._quiet.is_set():
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()

    def join(self) -> None:
        self._thread.join(timeout=10)


def _local_command(cfg: RecipeConfig, files: JobFiles) -> list[str]:
    """The agent (torchrun), or the single rank, as a module of this Python: the ranks run
    the same interpreter."""
    if importlib.util.find_spec("torch") is None:
        raise LaunchError(f"torch is not installed for {sys.executable}: install it to run here")
    return [sys.executable, *local_command(cfg, files.config_path)[1:]]


@dataclass(frozen=True)
class LocalRun:
    """How a local run ended: torchrun's exit code, and the signal we forwarded, if any."""

    code: int
    stopped_by: str | None = None
    """SIGINT, SIGTERM or SIGHUP when the user stopped the run; None when it ended itself."""


def run_local(files: JobFiles, cfg: RecipeConfig, lock_token: str | None = None) -> LocalRun:
    """Run torchrun for this run dir in the foreground until it exits.

    The child runs in its own process group and dies with this process; Ctrl-C, SIGTERM
    and SIGHUP (as SIGTERM) are forwarded to its group. A child killed by signal N exits
    with 128 + N, as a shell would report it.
    """
    args = _local_command(cfg, files)
    env = {**os.environ, **job_env(cfg), "PRETRAIN_SPAWN_T": str(time.time())}
    if lock_token:
        env[run_lock.TOKEN_ENV] = lock_token
    logs = files.run_dir / LOGS_DIR
    clear_failures(files.run_dir)
    quiet = threading.Event()
    stopped: list[str] = []
    log = _LaunchLog(logs / LAUNCH_LOG)
    try:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(args)}\n".encode())
        LOG.debug(f"running: {shlex.join(args)}")
        proc = subprocess.Popen(
            args, env=env, start_new_session=True, stderr=subprocess.PIPE,
            preexec_fn=child_dies_with_us(),
        )  # fmt: skip
        assert proc.stderr is not None
        tee = _StderrTee(proc.stderr, log, quiet, files.run_dir)
        code = wait_forwarding_signals(proc, quiet, stopped, cfg.cluster.signal_seconds)
        tee.join()
    finally:
        log.close()
    return LocalRun(128 - code if code < 0 else code, stopped[0] if stopped else None)


def wait_forwarding_signals(
    proc: subprocess.Popen, quiet: threading.Event, stopped: list[str], grace_s: float
) -> int:
    """Wait for `proc`, forwarding stop signals to its group (noted in `stopped`; its stderr
    turns quiet: the ranks' reactions to the signal are logged, not shown). A group still
    alive `grace_s` (plus a margin) after the first signal is killed, as torchrun kills its
    ranks after `--shutdown-timeout`: a rank started without the agent has no one else to."""

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    deadline = threading.Timer(grace_s + KILL_MARGIN_S, kill_group)
    deadline.daemon = True

    def forward(signum: int, _frame: object) -> None:
        quiet.set()
        stopped.append(signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
        if len(stopped) == 1:
            deadline.start()

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    # Signal handlers can only be installed from the main thread.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in forwarded} if in_main else {}
    try:
        return proc.wait()
    finally:
        deadline.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)


def submit_slurm(files: JobFiles) -> SubmittedJob:
    """Submit the run dir's job.sbatch with sbatch; the job starts in the current directory."""
    command = ["sbatch", "--parsable", str(files.script_path)]
    LOG.debug(f"running: {shlex.join(command)}")
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
    # `pretrain status RUN_DIR` asks SLURM about the run dir's last job.
    with contextlib.suppress(OSError):
        (files.run_dir / SLURM_JOB_FILE).write_text(job_id + "\n")
    return SubmittedJob(job_id=job_id, log_path=files.run_dir / LOGS_DIR / f"slurm-{job_id}.out")


def never_starts(job_id: str) -> str | None:
    """Why the job will never start as submitted (a pending reason of NEVER_STARTS, with the
    fix), or None while it runs, ran or may still start."""
    return _never_starts(job_id, show_job(job_id))


def _never_starts(job_id: str, fields: dict[str, str]) -> str | None:
    reason = fields.get("Reason", "")
    if fields["JobState"] != "PENDING" or reason not in NEVER_STARTS:
        return None
    return (
        f"SLURM job {job_id} cannot start (Reason={reason}): {NEVER_STARTS[reason]}; "
        f"cancel it with `scancel {job_id}`"
    )


def show_job(job_id: str) -> dict[str, str]:
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
        fields = show_job(job_id)
        state = fields["JobState"]
        if state in FINAL_STATES:
            return state
        problem = _never_starts(job_id, fields)
        if problem:
            raise LaunchError(problem)
        if time.monotonic() >= deadline:
            raise LaunchError(f"job {job_id} is still {state} after {timeout_s:g} s")
        time.sleep(1.0)
