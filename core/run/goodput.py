"""Where the wall time of a run went, over its whole life: every job, requeue and restart.

The main rank appends events to RUN_DIR/goodput.jsonl as they happen (one JSON object a
line, a single write each, so a crash leaves at most a cut last line, which is skipped):

- `attempt`: a group of ranks is training. `t0` is when that attempt started (the
  launcher's start for a fresh job, the rank's own start for a restart by torchrun, the
  job's start under SLURM), `t` when its first step starts; `load_s` of that was the
  checkpoint load, `resumed_from` the step it resumed from, `queue_s` the SLURM queue wait
  before the job started (absent when it could not be read, with `queue_note` saying why).
- `steps`: steps `first`..`last` ended at `t` and took `s` seconds of the loop (data,
  step, metrics), `eval_s` more in validation.
- `save`: the checkpoint of `step` kept the loop waiting `s` seconds, ending at `t`.
- `rollback`: a bad step made the run reload the checkpoint of step `to` (in `load_s`
  seconds): the steps since it are trained again;
- `end`: the trainer finished (`how`: finished or stopped) at `t`.
- `job_end`: the local launcher saw the ranks exit at `t` with exit status `code` (written
  by the launcher).

`breakdown` turns the events into terms that partition the run's wall time: productive
step time, checkpoint saves and loads, start-up, evaluation, steps recomputed after a
restart (trained past the checkpoint the next attempt resumed from), time lost to
failures (from a failed attempt's last event to the next attempt's start), the queue wait,
idle time between jobs (a stopped job to the next one's start, less its queue wait), and
shut-down (the trainer's end to the launcher's). `goodput = productive / total`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pretrain.core.run.durations import format_duration
from pretrain.core.run.rundir import GOODPUT_FILE


@dataclass
class Breakdown:
    """Seconds of a run's wall time by what they went to; `total_s` is the whole span."""

    productive_s: float = 0.0
    checkpoint_save_s: float = 0.0
    checkpoint_load_s: float = 0.0
    startup_s: float = 0.0
    evaluation_s: float = 0.0
    recomputed_s: float = 0.0
    failures_s: float = 0.0
    queue_s: float = 0.0
    between_jobs_s: float = 0.0
    shutdown_s: float = 0.0
    total_s: float = 0.0
    """From the first job's submission (its start less its queue wait) to the last event."""
    attempts: int = 0
    queue_notes: list[str] = field(default_factory=list)
    """Why a job's queue wait is not counted (not read from SLURM), one per such job."""

    @property
    def terms(self) -> dict[str, float]:
        """Every term but the total, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_s")
                and f.name != "total_s"}  # fmt: skip

    @property
    def unaccounted_s(self) -> float:
        """What no event measured (logging between the events, rounding)."""
        return self.total_s - sum(self.terms.values())

    @property
    def goodput(self) -> float | None:
        """Productive seconds over the total; None before any time passed."""
        return self.productive_s / self.total_s if self.total_s > 0 else None

    def metrics(self) -> dict[str, float | None]:
        """The flat metric names the trainer logs (`goodput`, `goodput_<term>`)."""
        out: dict[str, float | None] = {"goodput": self.goodput}
        out.update((f"goodput_{name}", round(value, 3)) for name, value in self.terms.items())
        out["goodput_total_s"] = round(self.total_s, 3)
        return out

    def line(self) -> str:
        """One line: the goodput and each term that took time, e.g. `goodput 81.2% of
        3m10s: productive 2m34s, checkpoint save 5.1s, ...`."""
        if self.goodput is None:
            return "goodput: nothing measured yet"
        parts = [
            f"{name.removesuffix('_s').replace('_', ' ')} {format_duration(value)}"
            for name, value in self.terms.items()
            if value >= 0.05
        ]
        if self.unaccounted_s >= 0.05:
            parts.append(f"unmeasured {format_duration(self.unaccounted_s)}")
        text = f"goodput {100 * self.goodput:.1f}% of {format_duration(self.total_s)}"
        text += f" over {self.attempts} attempt{'s' * (self.attempts != 1)}: " + ", ".join(parts)
        if self.queue_notes:
            text += f" (queue wait left out: {self.queue_notes[-1]})"
        return text


@dataclass
class _Segment:
    """Productive seconds of steps first..last, which a later resume may take back."""

    first: int
    last: int
    seconds: float


def _recompute(segments: list[_Segment], resumed_from: int) -> float:
    """Take the steps past `resumed_from` out of `segments` (they are trained again); the
    seconds they took, pro rata within a segment."""
    taken = 0.0
    for seg in segments:
        if seg.last <= resumed_from or seg.seconds <= 0:
            continue
        kept = max(0, resumed_from - seg.first + 1)
        share = (seg.last - seg.first + 1 - kept) / (seg.last - seg.first + 1)
        taken += seg.seconds * share
        seg.seconds -= seg.seconds * share
        seg.last = max(seg.first - 1, resumed_from)
    return taken


def _num(value: Any) -> float:
    """`value` as a finite float; 0 for anything else (a hand-edited or hostile line)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) else 0.0


class Account:
    """Folds events, one at a time in the order written, into a Breakdown: the trainer adds
    each event as it writes it, so a logged step costs the same late in a long run."""

    def __init__(self) -> None:
        self._out = Breakdown()
        self._segments: list[_Segment] = []
        self._productive = 0.0
        self._start: float | None = None
        self._last_t = 0.0
        self._ended_cleanly = False

    def add(self, event: dict[str, Any]) -> None:
        """Take in one event; one of no known kind is ignored."""
        kind, t = event.get("event"), _num(event.get("t"))
        if kind == "attempt":
            self._attempt(event, t)
        elif kind == "steps":
            last = int(_num(event.get("last")))
            seg = _Segment(int(_num(event.get("first"))), last, _num(event.get("s")))
            self._segments.append(seg)
            self._productive += seg.seconds
            self._out.evaluation_s += _num(event.get("eval_s"))
        elif kind == "save":
            self._out.checkpoint_save_s += _num(event.get("s"))
        elif kind == "rollback":
            self._take_back(int(_num(event.get("to"))))
            self._out.checkpoint_load_s += _num(event.get("load_s"))
        elif kind == "end":
            self._ended_cleanly = True
        elif kind == "job_end":
            if self._start is None:
                return
            # After a clean end the ranks were tearing down; otherwise the job had failed.
            if self._ended_cleanly and _num(event.get("code")) == 0:
                self._out.shutdown_s += max(0.0, t - self._last_t)
            else:
                self._out.failures_s += max(0.0, t - self._last_t)
            self._ended_cleanly = True
        else:
            return
        self._last_t = max(self._last_t, t)

    def _attempt(self, event: dict[str, Any], t: float) -> None:
        out = self._out
        t0 = _num(event["t0"]) if "t0" in event else t
        if "queue_note" in event:
            out.queue_notes.append(str(event["queue_note"]))
        queue_s = _num(event.get("queue_s"))
        if self._start is None:
            self._start = t0 - queue_s
            out.queue_s += queue_s
        else:
            gap = max(0.0, t0 - self._last_t)
            queued = min(queue_s, gap)
            out.queue_s += queued
            # A stopped job waited to be started again; a failed one lost the time.
            if self._ended_cleanly:
                out.between_jobs_s += gap - queued
            else:
                out.failures_s += gap - queued
        self._take_back(int(_num(event.get("resumed_from"))))
        load = _num(event.get("load_s"))
        out.checkpoint_load_s += load
        out.startup_s += max(0.0, t - t0 - load)
        out.attempts += 1
        self._ended_cleanly = False

    def _take_back(self, resumed_from: int) -> None:
        """The steps past `resumed_from` are trained again: recomputed, not productive."""
        taken = _recompute(self._segments, resumed_from)
        self._out.recomputed_s += taken
        self._productive -= taken

    def breakdown(self, now: float | None = None) -> Breakdown:
        """The terms so far; `now`, if given, ends the span (a run still training)."""
        out = dataclasses.replace(self._out, queue_notes=list(self._out.queue_notes))
        out.productive_s = self._productive
        if self._start is not None:
            out.total_s = max(self._last_t, now or 0.0) - self._start
        return out


def breakdown(events: list[dict[str, Any]], now: float | None = None) -> Breakdown:
    """The terms of `events` (in the order written); `now`, if given, ends the span."""
    account = Account()
    for event in events:
        account.add(event)
    return account.breakdown(now)


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    """Append one event to RUN_DIR/goodput.jsonl in a single write (a reader never sees
    half of it unless the machine died mid-write, and skips such a line)."""
    line = json.dumps({**event, "t": round(float(event.get("t", time.time())), 3)}) + "\n"
    fd = os.open(Path(run_dir) / GOODPUT_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


_SCONTROL_TIME = re.compile(r"\b(SubmitTime|StartTime)=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")


def scontrol_times(text: str) -> tuple[float, float] | None:
    """(SubmitTime, StartTime) as unix seconds from `scontrol --oneliner show job` output
    (local times, as SLURM prints them; a requeued job's SubmitTime is its requeue); None
    when either is missing."""
    found = dict(_SCONTROL_TIME.findall(text))
    if "SubmitTime" not in found or "StartTime" not in found:
        return None
    submit, started = (
        time.mktime(time.strptime(found[k], "%Y-%m-%dT%H:%M:%S"))
        for k in ("SubmitTime", "StartTime")
    )
    return submit, started
