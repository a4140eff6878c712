"""Where a step's time goes: forward, backward, optimizer and blocked time, per step.

The step marks its regions (`phases.phase("forward")` ...); a logging window reads their
totals (`take`) and reports them per step beside the data wait. On CUDA each region is a
pair of CUDA events on the current stream (no synchronization until `take`); elsewhere it
is wall time. A pipelined step cannot separate forward from backward (the schedule
interleaves them, bubble included): it is one `forward_backward` region.

Blocked time, on CPU only: the part of the regions' wall time in which this rank's main
thread ran nothing, i.e. waited in a collective (its exposed communication) or for a peer;
on a loaded machine it also counts time the thread was descheduled. On CUDA the host spins
while waiting, so the figure is left out there (the profiler shows the kernels' overlap).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class StepPhases:
    """Accumulates the time of a step's regions until a logging window takes it."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self._totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str, within: bool = False) -> Iterator[None]:
        """Time the enclosed block as region `name`. A region `within` another (the stability
        monitors' share of a forward or an optimizer step) is a part of that one's time: it
        adds nothing to the blocked time, which the enclosing region counts. Other regions
        must not nest: they would count twice."""
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall = time.perf_counter() - wall
            cpu = time.thread_time() - cpu
            self._totals[name] += wall
            if not within:
                self._totals["blocked"] += max(0.0, wall - cpu)

    def take(self, steps: int) -> dict[str, float]:
        """Seconds per step of each region timed since the last call (`time_<region>_s`,
        and `time_blocked_s` on CPU), then start over."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                self._totals[name] += start.elapsed_time(end) / 1000
        out = {f"time_{name}_s": total / max(steps, 1) for name, total in self._totals.items()}
        self._totals.clear()
        self._events.clear()
        return out


OFF = StepPhases(torch.device("cpu"), enabled=False)
"""A recorder that times nothing: the default of a state no window reads."""
