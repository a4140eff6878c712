"""Where a step's time goes: forward, backward, optimizer, bubble and blocked time, per step.

The step marks its regions (`phases.phase("forward")` ...); a logging window reads their
totals (`take`) and reports them per step beside the data wait. On CUDA each region is a
pair of CUDA events on the current stream (no synchronization until `take`); elsewhere it
is wall time.

A pipelined step runs its schedule in a `pipeline` region that holds this rank's forward
and backward regions (its stages' forwards and the loss, their backwards): what the region
spends outside them is the bubble, this rank waiting for its peers' activations and
gradients (their transfer included), reported as `time_bubble_s`.

Blocked time, on CPU only: the part of the forward, backward and optimizer regions in which
this rank's main thread ran nothing, i.e. waited in a collective or for a peer (the exposed
communication: tensor-parallel reductions, the data-parallel gradient reduction it waits
for, the norm's all-reduce); on a loaded machine it also counts time the thread was
descheduled. The bubble is not counted in it. On CUDA the host spins while waiting, so the
figure is left out there (the profiler shows the kernels' overlap).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

CONTAINER = "pipeline"
"""The region of a pipeline schedule: its time outside the regions inside is the bubble."""


class StepPhases:
    """Accumulates the time of a step's regions until a logging window takes it."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self._totals: dict[str, float] = defaultdict(float)
        self._inside = 0.0
        """Seconds of the regions timed inside the pipeline region."""
        self._in_container = False
        self._events: list[tuple[str, bool, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str, within: bool = False) -> Iterator[None]:
        """Time the enclosed block as region `name`. Regions do not nest, except inside the
        `pipeline` region, whose time outside them is the bubble, and a region `within`
        another (the stability monitors' share of a forward or an optimizer step): a part
        of that one's time, it adds nothing to the blocked time or to what the bubble
        excludes, which the enclosing region counts."""
        if not self.enabled:
            yield
            return
        container = name == CONTAINER
        inside = self._in_container and not container and not within
        self._in_container |= container
        try:
            if self.device.type == "cuda":
                with self._cuda_region(name, inside):
                    yield
            else:
                with self._wall_region(name, inside, container or within):
                    yield
        finally:
            if container:
                self._in_container = False

    @contextlib.contextmanager
    def _cuda_region(self, name: str, inside: bool) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((name, inside, start, end))

    @contextlib.contextmanager
    def _wall_region(self, name: str, inside: bool, unblocked: bool) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall = time.perf_counter() - wall
            cpu = time.thread_time() - cpu
            self._add(name, wall, inside)
            # The container's waiting is the bubble; a region within another counts in it.
            if not unblocked:
                self._totals["blocked"] += max(0.0, wall - cpu)

    def _add(self, name: str, seconds: float, inside: bool) -> None:
        self._totals[name] += seconds
        if inside:
            self._inside += seconds

    def take(self, steps: int) -> dict[str, float]:
        """Seconds per step of each region timed since the last call (`time_<region>_s`;
        the pipeline region as `time_bubble_s`, and `time_blocked_s` on CPU), then start
        over."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, inside, start, end in self._events:
                self._add(name, start.elapsed_time(end) / 1000, inside)
        if CONTAINER in self._totals:
            self._totals["bubble"] = max(0.0, self._totals.pop(CONTAINER) - self._inside)
        out = {f"time_{name}_s": total / max(steps, 1) for name, total in self._totals.items()}
        self._totals.clear()
        self._events.clear()
        self._inside = 0.0
        return out


OFF = StepPhases(torch.device("cpu"), enabled=False)
"""A recorder that times nothing: the default of a state no window reads."""
