"""A file lock on a shared cache (a prepared dataset, a trained tokenizer) that says who
holds it and how far along the holder is, so that everyone waiting on it can show it.

The holder writes a note beside the lock (`NAME.lock.holder`: its host, PID, start time
and SLURM job, and its latest progress line), replaced whole each time and removed on
release. The lock itself is the kernel's (`filelock`): a killed holder releases it, and
its note is overwritten by the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from pretrain.core.inputs.reading import ReadError, number, read_mapping, text
from pretrain.core.run.run_lock import LockHolder
from pretrain.dataprep.shards import write_json_atomic
from pretrain.dataprep.waiting import Report, Wait

NOTE_SUFFIX = ".holder"


def note_path(lock: Path) -> Path:
    """Where the holder of `lock` describes itself."""
    return lock.with_name(lock.name + NOTE_SUFFIX)


def read_note(lock: Path) -> dict[str, Any] | None:
    """The holder's note; None when there is none (or it is being replaced)."""
    try:
        return read_mapping(note_path(lock), "a lock holder's note")
    except ReadError:
        return None


def holder_detail(lock: Path) -> str:
    """'held by pid 12 on host n1 since ...; <its progress line>', or '' without a note."""
    note = read_note(lock)
    if note is None:
        return ""
    line = text(note.get("line"))
    return f"held by {text(note.get('holder'), 'another process')}" + (f"; {line}" if line else "")


def holder_fraction(lock: Path) -> float | None:
    """How much of its work the holder says it has done; None when it does not say."""
    note = read_note(lock)
    return None if note is None else number(note.get("fraction"))


class Holding:
    """The note of a held lock: who holds it and, as it goes, how far along it is."""

    def __init__(self, lock: Path) -> None:
        self.path = note_path(lock)
        self.holder = LockHolder.this_process().describe()
        self.publish(None, "")

    def publish(self, fraction: float | None, line: str) -> None:
        """Say how much is done (None: unknown) and the current progress line."""
        write_json_atomic(self.path, {"holder": self.holder, "fraction": fraction, "line": line})


@contextlib.contextmanager
def held(
    lock: Path, what: str, report: Report | None = None, tty: bool | None = None
) -> Iterator[Holding]:
    """Hold `lock` for the block; while another process holds it, show the wait ('<what>
    (held by ...)', its progress and the time waited)."""
    file_lock = FileLock(str(lock))
    try:
        file_lock.acquire(timeout=0)
    except Timeout:
        with Wait(
            what,
            report,
            tty=tty,
            detail=lambda: holder_detail(lock),
            fraction=lambda: holder_fraction(lock),
        ):
            file_lock.acquire()
    try:
        yield Holding(lock)
    finally:
        note_path(lock).unlink(missing_ok=True)
        file_lock.release()
