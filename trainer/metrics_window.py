"""One logging window of steps: its timing and the metrics dict logged at its end.

The loop tells the window when a step waits for data and when it finishes; at a logging
step `collect` averages the loss over the data-parallel ranks, turns the window's wall time
into throughput (`ThroughputMeter`), adds memory, loss-scaler, skipped-step and MoE routing
metrics, names a straggler, and starts the next window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from trainer.faults import StepGuard, gather_step_times, slowest_rank
from trainer.log import get_logger
from trainer.metrics import ThroughputMeter, peak_memory_gib
from trainer.moe_metrics import expert_load_metrics
from trainer.step import StepResult, TrainState

T = TypeVar("T")


class MetricsWindow:
    """Times the steps between two logged steps and builds the metrics of the logged one."""

    def __init__(
        self,
        meter: ThroughputMeter,
        *,
        state: TrainState,
        guard: StepGuard,
        device: torch.device,
        dp_group: dist.ProcessGroup,
        log_every: int,
        straggler_lag: float,
        moe_pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.meter = meter
        self.state = state
        self.guard = guard
        self.device = device
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.log_every = log_every
        self.straggler_lag = straggler_lag
        self.moe_pp_group = moe_pp_group
        self._model: nn.Module = state.plain
        self._lr = 0.0
        self._last: StepResult | None = None
        self._reset()

    def _reset(self) -> None:
        self._start = time.perf_counter()
        self._data_wait = 0.0
        self._steps = 0

    def wait_for_data(self, next_batch: Callable[[], T]) -> T:
        """Call `next_batch`, timing it as the window's data wait."""
        start = time.perf_counter()
        batch = next_batch()
        self._data_wait += time.perf_counter() - start
        # The lr the step about to run uses (the schedule advances inside the step).
        self._lr = self.state.scheduler.get_last_lr()[0]
        return batch

    def step_done(self, result: StepResult) -> None:
        """Count a finished step and keep its loss and gradient norm for the log."""
        self._steps += 1
        self._last = result

    def due(self, step: int, last: bool, stop: bool) -> bool:
        """Whether `step` is logged: every `log_every` steps, the last one and a stop."""
        return step % self.log_every == 0 or last or stop

    def collect(self, step: int) -> dict[str, Any]:
        """The metrics of the window ending at `step` (collective); starts the next window."""
        assert self._last is not None, "collect() before any step"
        loss, norm = self._last.loss, self._last.grad_norm
        dist.all_reduce(loss, group=self.dp_group)
        loss_value = loss.item() / self.dp_size
        elapsed = time.perf_counter() - self._start
        self._report_straggler(step, elapsed / self._steps)
        metrics = {
            # Non-finite values are written as null: metrics.jsonl stays strict JSON.
            "loss": loss_value if math.isfinite(loss_value) else None,
            "lr": self._lr,
            # An overflowed fp16 step has no norm; None keeps metrics.jsonl strict JSON.
            "grad_norm": norm.item() if torch.isfinite(norm) else None,
            **self.meter.measure(steps=self._steps, elapsed_s=elapsed, data_wait_s=self._data_wait),
            "mem_peak_gib": peak_memory_gib(self.device),
            **self.state.scaler.metrics(),
            "skipped_steps": self.guard.skipped + self.state.scaler.skipped_steps,
            **expert_load_metrics(self._model, self.dp_group, self._steps, self.moe_pp_group),
        }
        self._reset()
        return metrics

    def _report_straggler(self, step: int, mean_step_s: float) -> None:
        """Name the slowest rank when it lags the median step time by more than the lag."""
        times = gather_step_times(mean_step_s, self.device)
        slow = slowest_rank(times, self.straggler_lag)
        if slow is not None:
            get_logger().info(
                "step %d: rank %d is a straggler: %.3f s/step, %.0f%% over the median",
                step,
                slow[0],
                times[slow[0]],
                100 * slow[1],
            )
