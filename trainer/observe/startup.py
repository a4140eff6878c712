"""Where the time from `pretrain` to the first finished step goes, logged once per run.

The launcher stamps its own start (PRETRAIN_LAUNCH_T0) and the moment it spawns torchrun,
or the rank itself for a one-rank run (PRETRAIN_SPAWN_T), into the environment; each rank
stamps its process start (PRETRAIN_RANK_T0, first thing in `trainer/__main__.py`) and marks
the end of each setup phase. The line after the first step reads, e.g.: launcher 0.9 s,
spawn 1.6 s (torchrun's agent, until it started this rank), imports
2.7 s, process group 0.1 s, mesh 0.0 s, data 0.4 s, model 0.3 s, ... first step 0.5 s.
Wall-clock stamps: comparable across processes of one node. Under SLURM the rank's own
start is the first stamp (the queue wait is no part of the start).
"""

from __future__ import annotations

import os
import time

LAUNCH_ENV, SPAWN_ENV, RANK_ENV = "PRETRAIN_LAUNCH_T0", "PRETRAIN_SPAWN_T", "PRETRAIN_RANK_T0"


class StartupClock:
    """Phase boundaries of this rank's start, as (name, wall-clock end) pairs."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []
        self.reported = False

    def _stamps(self) -> None:
        # Read at the first mark, not at import: a rank forked from the agent (which
        # imported this module) stamps its own start after the fork.
        stamps = [("start", LAUNCH_ENV), ("launcher", SPAWN_ENV), ("spawn", RANK_ENV)]
        if SPAWN_ENV not in os.environ:
            # Not spawned by the local backend (e.g. a SLURM job, whose environment may still
            # carry the submitting launcher's stamp): the queue is no part of the start.
            stamps = stamps[2:]
        for name, env in stamps:
            if env in os.environ:
                self.marks.append((name, float(os.environ[env])))

    def mark(self, name: str, at: float | None = None) -> None:
        """The phase `name` ends now (or at wall-clock time `at`)."""
        if not self.marks:
            self._stamps()
        self.marks.append((name, time.time() if at is None else at))

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, in order, and `total` from the first stamp."""
        out: dict[str, float] = {}
        for (_, before), (name, at) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = at - before
        if len(self.marks) > 1:
            out["total"] = self.marks[-1][1] - self.marks[0][1]
        return out

    def line(self) -> str:
        """The phases as one log line."""
        phases = self.phases()
        total = phases.pop("total", 0.0)
        since = "launch" if self.marks and self.marks[0][0] == "start" else "the first stamp"
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
        return f"startup: {parts}; {total:.2f} s from {since} to the first step"


CLOCK = StartupClock()
"""This process's clock (one per rank)."""
