"""A hang names its ranks: which collective each rank last entered, and who never arrived.

Every process group counts the collectives a rank issues on it (torch's per-group sequence
number, kept in C++ for every collective, DDP's and FSDP's included). A rank's record holds,
for each group it is in, that count, the operation of the last one where the flight
recorder knows it (on NCCL every issued collective; on gloo the completed ones), and the
step and phase of the loop. Records are written to RUN_DIR/hangs/rank_R.json:

- by a watchdog thread when the rank has made no progress for the limit of the phase it is
  in (`trainer/faults/timeouts.py`: the constant `faults.collective_timeout_s` until a
  phase was measured, then a factor of its longest time; a rank stuck outside any
  collective, or blocked in one, writes it all the same);
- by the rank itself when a step fails, before the error leaves it.

A rank whose collective timed out (or whose peer's connection closed) reads the records of
the others and raises a CollectiveTimeout naming, for each group whose members' counts
differ, the ranks behind: those never arrived at the collective the others wait in. On CUDA
NCCL's own flight recorder is also dumped there on a timeout.

Point-to-point traffic counts too: on pipelines of three or more stages the members of a
pipeline group issue different numbers of sends and receives by design, so a difference
there is only a hint.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.core.inputs.reading import ReadError, integer, read_mapping
from pretrain.core.run.rundir import HANGS_DIR
from pretrain.trainer.faults.timeouts import PhaseTimeouts
from pretrain.trainer.log import get_logger

_COMMUNICATION_ERRORS = ("Timed out", "timed out", "Connection closed", "Connection reset")
"""What gloo's and NCCL's errors say when a peer never came or went away."""

FLIGHT_RECORDER_ENTRIES = "2000"
MAX_GROUPS_NAMED = 3


class CollectiveTimeout(RuntimeError):
    """A collective waited past its timeout; the message names the ranks that never arrived."""


def enable_flight_recorder(run_dir: Path, device_type: str) -> None:
    """Turn on torch's flight recorder for this rank (before its process group exists); on
    CUDA, NCCL dumps it into RUN_DIR/hangs when a collective times out. Settings already in
    the environment are kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if device_type == "cuda":
        (run_dir / HANGS_DIR).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = str(run_dir / HANGS_DIR / "nccl_trace_rank_")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)


def _last_operations() -> dict[tuple[str, int], str]:
    """(group name, collective number) -> operation, for what the flight recorder holds."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except (ImportError, RuntimeError, ValueError):
        return {}
    return {
        (e["process_group"][0], int(e["collective_seq_id"])): e["profiling_name"]
        for e in entries
        if not e.get("is_p2p")
    }


def group_progress() -> dict[str, dict[str, Any]]:
    """This rank's progress in each of its process groups: description, member ranks, the
    number of collectives issued and the operation of the last one (None if unknown)."""
    operations = _last_operations()
    progress = {}
    for group, name in _groups():
        count = group._get_sequence_number_for_group()
        progress[name] = {
            "desc": group.group_desc,
            "ranks": dist.get_process_group_ranks(group),
            "entered": count,
            "operation": operations.get((name, count)),
        }
    return progress


def _groups() -> list[tuple[dist.ProcessGroup, str]]:
    """Every process group of this rank and its name (the same on every rank)."""
    # Private, but the one registry of them all; the main thread may be adding one.
    registry = dist.distributed_c10d._world.pg_names
    for _ in range(10):
        try:
            return list(registry.items())
        except RuntimeError:
            continue
    return []


def set_group_timeouts(timeout_s: float) -> None:
    """Make `timeout_s` the timeout of every later collective on each of this rank's groups.

    torch 2.13 changes a live group's timeout through the private `_set_pg_timeout` (gloo's
    and NCCL's backends both take it, for the work issued after the call); building new
    groups instead would cost a rendezvous per change and leave the job's mesh, DDP and
    FSDP on the old ones.
    """
    timeout = timedelta(seconds=timeout_s)
    for group, _ in _groups():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


class Watchdog:
    """Writes this rank's record when it stalls or fails, explains a timeout, and keeps the
    limit of the loop's phase in force (its own, and every collective's)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeouts: PhaseTimeouts) -> None:
        self.dir = Path(run_dir) / HANGS_DIR
        self.rank = rank
        self.world_size = world_size
        self.timeouts = timeouts
        self.timeout_s = timeouts.limit("setup")
        self.host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._where: tuple[int, str] = (0, "setup")
        self._since = time.monotonic()
        self._written_for: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        # A record left by an earlier run of this run dir would tell of another hang.
        (self.dir / f"rank_{self.rank}.json").unlink(missing_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def beat(self, step: int, phase: str) -> None:
        """The loop reached `phase` of `step`: progress; the step before it is measured."""
        now = time.monotonic()
        if self._where[1] == "training":
            self.timeouts.measured("step", now - self._since)
        limit = self.timeouts.limit(phase)
        if limit != self.timeout_s:
            set_group_timeouts(limit)
            self.timeout_s = limit
        self._where, self._since = (step, phase), now

    def measured(self, kind: str, seconds: float) -> None:
        """A save or an evaluation took `seconds` (the loop times them, the watchdog cannot
        tell a step that saved from one that did not)."""
        self.timeouts.measured(kind, seconds)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            since = self._since
            stalled = time.monotonic() - since
            if stalled >= self.timeout_s and self._written_for != since:
                self._written_for = since
                path = self.write(f"no progress for {stalled:.0f} s")
                get_logger().warning(
                    "rank %d: no progress for %.0f s at step %d (%s); its last collectives: %s",
                    self.rank, stalled, *self._where, path,
                )  # fmt: skip

    def write(self, reason: str) -> Path:
        """Write this rank's record now; returns its path."""
        step, phase = self._where
        record = {
            "rank": self.rank,
            "host": self.host,
            "step": step,
            "phase": phase,
            "reason": reason,
            "groups": group_progress(),
        }
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"rank_{self.rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, path)
        return path

    def explain(self, error: BaseException) -> CollectiveTimeout | None:
        """Write this rank's record for `error`; for a communication error, wait briefly for
        the other ranks' records and return the error naming those that never arrived."""
        self._stop.set()
        self.write(f"{type(error).__name__}: {str(error)[:300]}")
        if not any(text in str(error) for text in _COMMUNICATION_ERRORS):
            return None
        records = self._read_records(wait_s=min(self.timeout_s, 10.0))
        step, phase = self._where
        return CollectiveTimeout(
            f"rank {self.rank} (host {self.host}), step {step} ({phase}): a collective failed "
            f"({str(error).splitlines()[0][:200]}); {missing_ranks(records)}; every rank's "
            f"last collectives are in {self.dir}"
        )

    def _read_records(self, wait_s: float) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + wait_s
        while True:
            records = {}
            for path in self.dir.glob("rank_*.json"):
                try:
                    record = read_mapping(path, "a rank's collective record")
                    rank = integer(record.get("rank"), path, "rank")
                except ReadError:
                    continue  # being replaced: read it on the next pass
                if rank is not None:
                    records[rank] = record
            if len(records) >= self.world_size or time.monotonic() >= deadline:
                return records
            time.sleep(0.2)


def missing_ranks(records: dict[int, dict[str, Any]]) -> str:
    """Who never arrived: for each group whose members issued different numbers of
    collectives, the members behind the furthest one (or without a record)."""
    findings = []
    groups: dict[str, dict[str, Any]] = {}
    for record in records.values():
        for name, state in record["groups"].items():
            groups.setdefault(name, state)
    # The largest groups first: the world shows a missing rank to all the others.
    for name, group in sorted(groups.items(), key=lambda item: -len(item[1]["ranks"])):
        counts = {
            r: records[r]["groups"][name]["entered"] if r in records else None
            for r in group["ranks"]
        }
        furthest = max(c for c in counts.values() if c is not None)
        behind = [r for r, c in counts.items() if c is None or c < furthest]
        if not behind:
            continue
        leader = next(r for r, c in counts.items() if c == furthest)
        operation = records[leader]["groups"][name]["operation"] or "operation unknown"
        findings.append(
            f"on group {group['desc'] or name} (ranks {group['ranks']}) ranks "
            f"{[r for r, c in counts.items() if c == furthest]} entered collective #{furthest} "
            f"({operation}) and ranks {behind} never arrived: "
            + ", ".join(_whereabouts(r, name, records) for r in behind)
        )
    if len(findings) > MAX_GROUPS_NAMED:
        more = len(findings) - MAX_GROUPS_NAMED
        findings = [*findings[:MAX_GROUPS_NAMED], f"and {more} more groups (see the records)"]
    return "; ".join(findings) or "every rank that left a record reached the same collectives"


def _whereabouts(rank: int, group: str, records: dict[int, dict[str, Any]]) -> str:
    if rank not in records:
        return f"rank {rank} left no record (its process may have died)"
    record = records[rank]
    state = record["groups"][group]
    operation = f" ({state['operation']})" if state["operation"] else ""
    return (
        f"rank {rank} (host {record['host']}) last entered #{state['entered']}{operation} "
        f"at step {record['step']} ({record['phase']}; {record['reason']})"
    )
