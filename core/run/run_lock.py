"""One trainer per run dir: an exclusive lock file that names its holder.

The launcher takes the lock for a local run and hands its token to the ranks in
PRETRAIN_RUN_LOCK, so rank 0 knows the lock is its own; rank 0 takes it itself when the
job was started another way (SLURM, run.sh). Anyone else is refused with the holder's
host, PID, start time and SLURM job id. A stale lock (its process is gone from this host,
or its SLURM job has ended) is taken over, and the caller says so.

The lock file is created whole or not at all (written aside, then hard-linked into place),
so a reader never sees half a holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain.core.run.rundir import LOCK_FILE

TOKEN_ENV = "PRETRAIN_RUN_LOCK"
"""The launcher's lock token, passed to the ranks of a local run."""

SLURM_FINAL_STATES = frozenset(
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


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run dir: enough to find the process, and to tell a reused PID apart."""

    host: str
    pid: int
    started: str
    """Local time the lock was taken, ISO 8601."""
    token: str
    slurm_job_id: str = ""
    pid_start: int = 0
    """The process's start time in clock ticks since boot (/proc/PID/stat); 0 if unknown."""

    @classmethod
    def this_process(cls) -> LockHolder:
        """A holder record for the calling process."""
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            token=secrets.token_hex(8),
            slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
            pid_start=_pid_start(os.getpid()),
        )

    def describe(self) -> str:
        """'pid 123 on host h since 2025-01-01T10:00:00+0000 (SLURM job 42)'."""
        job = f" (SLURM job {self.slurm_job_id})" if self.slurm_job_id else ""
        return f"pid {self.pid} on host {self.host} since {self.started}{job}"


class RunDirInUse(RuntimeError):
    """Another live trainer holds the run dir."""

    def __init__(self, run_dir: Path, holder: LockHolder, unsure: bool = False) -> None:
        self.holder = holder
        lock = Path(run_dir) / LOCK_FILE
        if unsure:
            advice = f"this host cannot tell whether it still runs: if it does not, remove {lock}"
        else:
            advice = "wait for it to finish or stop it, or pick another run.dir"
        super().__init__(f"run dir {run_dir} is in use by {holder.describe()}; {advice}")


def _pid_start(pid: int) -> int:
    """Field 22 of /proc/PID/stat (start time in ticks); 0 where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int, pid_start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return not pid_start or _pid_start(pid) in (0, pid_start)


def slurm_job_ended(job_id: str) -> bool | None:
    """True if SLURM says the job is over (or no longer knows it), False if it is pending or
    running, None if SLURM cannot be asked from here."""
    try:
        result = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    for word in result.stdout.split():
        if word.startswith("JobState="):
            return word.removeprefix("JobState=") in SLURM_FINAL_STATES
    return True if "Invalid job id" in result.stderr else None


def holder_alive(holder: LockHolder) -> bool | None:
    """Whether the holder still runs: its PID on this host, else its SLURM job; None when
    neither can be checked from here."""
    if holder.host == socket.gethostname():
        return _pid_alive(holder.pid, holder.pid_start)
    if holder.slurm_job_id:
        ended = slurm_job_ended(holder.slurm_job_id)
        return None if ended is None else not ended
    return None


def _parse(text: str) -> LockHolder:
    try:
        return LockHolder(**json.loads(text))
    except (ValueError, TypeError) as err:
        raise ValueError("not a lock this version wrote") from err


def read_holder(run_dir: Path) -> LockHolder | None:
    """The current holder; None when the run dir is not locked. A lock file that cannot be
    read as a holder raises ValueError."""
    from pretrain.core.inputs.reading import MissingFile, read_text

    try:
        text = read_text(Path(run_dir) / LOCK_FILE, "the run dir's lock (JSON)", 1 << 16)
    except MissingFile:
        return None
    try:
        return _parse(text)
    except ValueError as err:
        raise ValueError(f"{Path(run_dir) / LOCK_FILE} is {err}") from err


def _create(lock: Path, holder: LockHolder) -> bool:
    """Create the lock file holding `holder`; False if one exists already."""
    aside = lock.with_name(f".{lock.name}.{holder.token}")
    aside.write_text(json.dumps(asdict(holder)) + "\n")
    try:
        os.link(aside, lock)
        return True
    except FileExistsError:
        return False
    finally:
        aside.unlink(missing_ok=True)


def _stale_reason(run_dir: Path, holder: LockHolder | None) -> str:
    """Why the existing lock may be taken over; raises RunDirInUse when it may not."""
    if holder is None:
        return "an unreadable lock"
    if holder.slurm_job_id and holder.slurm_job_id == os.environ.get("SLURM_JOB_ID"):
        return f"an earlier attempt of this SLURM job ({holder.describe()})"
    alive = holder_alive(holder)
    if alive is False:
        return f"{holder.describe()}, which is no longer running"
    raise RunDirInUse(run_dir, holder, unsure=alive is None)


def _read_text(path: Path) -> str | None:
    from pretrain.core.inputs.reading import MissingFile, read_text

    try:
        return read_text(path, "the run dir's lock (JSON)", 1 << 16)
    except MissingFile:
        return None


def _remove_stale(lock: Path, seen: str, token: str) -> bool:
    """Remove the lock file if it still holds `seen`; False if another claimant got there
    first (its fresh lock is put back)."""
    aside = lock.with_name(f".{lock.name}.stale.{token}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if _read_text(aside) == seen:
        aside.unlink()
        return True
    with contextlib.suppress(FileExistsError):
        os.link(aside, lock)
    aside.unlink()
    return False


def acquire(
    run_dir: Path, holder: LockHolder, inherited: str | None = None
) -> tuple[bool, str | None]:
    """Take the run dir's lock for `holder`.

    Returns (acquired, note): acquired is False when the lock already carries the token
    `inherited` (a launcher took it for this job); note says which stale lock was taken
    over. Raises RunDirInUse naming a live holder.
    """
    run_dir = Path(run_dir)
    lock = run_dir / LOCK_FILE
    note = None
    for _ in range(5):
        seen = _read_text(lock)
        if seen is None:
            # Nothing is written while a live holder has the lock: look before creating.
            run_dir.mkdir(parents=True, exist_ok=True)
            if _create(lock, holder):
                return True, note
            continue
        try:
            current: LockHolder | None = _parse(seen)
        except ValueError:
            current = None
        if current is not None and inherited and current.token == inherited:
            return False, None
        reason = _stale_reason(run_dir, current)
        if _remove_stale(lock, seen, holder.token):
            note = f"took over the lock of {reason}"
    raise RunDirInUse(run_dir, read_holder(run_dir) or holder)


def check_free(run_dir: Path) -> None:
    """Raise RunDirInUse if a live trainer holds `run_dir` (nothing is written)."""
    try:
        holder = read_holder(run_dir)
    except ValueError:
        return
    if holder is not None:
        _stale_reason(Path(run_dir), holder)


def release(run_dir: Path, token: str) -> None:
    """Remove the lock if it still carries `token` (a takeover's lock is left alone)."""
    with contextlib.suppress(ValueError, OSError):
        holder = read_holder(run_dir)
        if holder is not None and holder.token == token:
            (Path(run_dir) / LOCK_FILE).unlink()


@contextlib.contextmanager
def held(run_dir: Path, enabled: bool = True) -> Iterator[str | None]:
    """Hold the run dir's lock for the block (unless the launcher already holds it for this
    job, PRETRAIN_RUN_LOCK); yields the takeover note, if any. `enabled=False` does
    nothing (ranks other than 0)."""
    if not enabled:
        yield None
        return
    holder = LockHolder.this_process()
    acquired, note = acquire(run_dir, holder, os.environ.get(TOKEN_ENV))
    try:
        yield note
    finally:
        if acquired:
            release(run_dir, holder.token)
