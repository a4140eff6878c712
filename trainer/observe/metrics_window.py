"""One logging window of steps: its timing and the metrics dict logged at its end.

The loop tells the window when a step waits for data and runs the step through it; at a
logging step `collect` averages the loss over the data-parallel ranks, turns the window's
wall time into throughput (`ThroughputMeter`), adds memory, loss-scaler, skipped-step, MoE
routing and multi-token prediction metrics, names stragglers, adds each node's system
figures when it sampled them (`system_metrics.py`, in the same gather), and starts the next
window.

A straggler is found by each rank's own compute, not its step time: every rank waits in the
step's blocking collectives for the slowest, so their step times are all alike. The compute
of a step (forward, backward, optimizer) is the CPU time of the rank's main thread while it
runs the step: a rank blocked in a collective sleeps and adds nothing to it. Ranks are
compared with their peers (the ranks of the same pipeline stage, which do the same work),
and a rank is named when its extra compute is more than `faults.straggler_lag` of the
median of the others (and more than a noise floor, STRAGGLER_MIN_S).
On CUDA the host spins while it waits for the device, so this measure cannot tell the ranks
apart there and names no one.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pretrain.trainer.faults.step_guard import StepGuard, gather_compute, stragglers
from pretrain.trainer.log import get_logger
from pretrain.trainer.observe.compile_watch import CompileWatch
from pretrain.trainer.observe.metrics import ThroughputMeter, peak_memory_gib
from pretrain.trainer.observe.moe_metrics import expert_load_metrics
from pretrain.trainer.observe.system_metrics import NodeSampler, host_metrics
from pretrain.trainer.step.state import MicroBatches, Stepper, StepResult, TrainState

T = TypeVar("T")
P = ParamSpec("P")


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
        stage: int = 0,
        moe_pp_group: dist.ProcessGroup | None = None,
        data_metrics: Callable[[int], dict[str, Any]] = lambda step: {},
        system_every_s: float = 0.0,
        compile_watch: CompileWatch | None = None,
        pp_group: dist.ProcessGroup | None = None,
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
        self.data_metrics = data_metrics
        self.compile_watch = compile_watch or CompileWatch(enabled=False)
        self.pp_group = pp_group
        self.stage = stage
        self.hosts = _hosts()
        self.sampler = NodeSampler(device, system_every_s)
        self._model: nn.Module = state.plain
        self._lr = 0.0
        self._last: StepResult | None = None
        self._reset()

    def _reset(self) -> None:
        self._start = time.perf_counter()
        self._data_wait = 0.0
        self._compute = 0.0
        self._steps = 0

    def wait_for_data(self, next_batch: Callable[[], T]) -> T:
        """Call `next_batch`, timing it as the window's data wait."""
        start = time.perf_counter()
        batch = next_batch()
        self._data_wait += time.perf_counter() - start
        # The lr the step about to run uses (the schedule advances inside the step; a rollback
        # may have lowered it).
        self._lr = self.state.optimizer.param_groups[0]["lr"]
        return batch

    def untimed(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call `work` (an evaluation) outside the window's time, so throughput and MFU
        count training steps only."""
        start = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            self._start += time.perf_counter() - start

    def run_step(self, stepper: Stepper, micro_batches: MicroBatches) -> StepResult:
        """Run one optimizer step, timing this rank's own compute in it; count the step and
        keep its loss and gradient norm for the log."""
        start = time.thread_time()
        result = self.compile_watch.step(lambda: stepper.step(micro_batches))
        self._compute += time.thread_time() - start
        self._steps += 1
        self._last = result
        return result

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
        system = self._report_stragglers(step, self._compute / self._steps)
        metrics = {
            # Non-finite values are written as null: metrics.jsonl stays strict JSON.
            "loss": loss_value if math.isfinite(loss_value) else None,
            "lr": self._lr,
            # An overflowed fp16 step has no norm; None keeps metrics.jsonl strict JSON.
            "grad_norm": norm.item() if torch.isfinite(norm) else None,
            **self.meter.measure(
                steps=self._steps, elapsed_s=elapsed, data_wait_s=self._data_wait, last_step=step
            ),
            **self._step_breakdown(),
            "mem_peak_gib": peak_memory_gib(self.device),
            **self.state.scaler.metrics(),
            "skipped_steps": self.guard.skipped + self.state.scaler.skipped_steps,
            **expert_load_metrics(
                self._model, self.state.routing_group, self._steps, self.moe_pp_group
            ),
            **self.data_metrics(step),
            **system,
            **self.compile_watch.metrics(),
        }
        if self.state.mtp is not None:
            metrics.update(self.state.mtp.metrics(self.device, self.dp_group))
        self._reset()
        return metrics

    def _step_breakdown(self) -> dict[str, float]:
        """This rank's `time_*_s` regions per step; in a pipeline, every pipeline rank's too,
        as `time_stage<r>_*_s` (collective over the pipeline group)."""
        mine = self.state.phases.take(self._steps)
        if self.pp_group is None:
            return mine
        stages: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(self.pp_group))]
        dist.all_gather_object(stages, mine, group=self.pp_group)
        per_stage = {
            f"time_stage{rank}_{name.removeprefix('time_')}": seconds
            for rank, regions in enumerate(stages)
            for name, seconds in regions.items()
        }
        return {**mine, **per_stage}

    def _report_stragglers(self, step: int, compute_s: float) -> dict[str, float]:
        """Name each rank whose compute lags its peers' median by more than the lag; return
        the system figures the nodes sent with their compute."""
        compute, peers, figures = gather_compute(
            compute_s, self.stage, self.device, self.sampler.sample()
        )
        for rank, excess in stragglers(compute, peers, self.straggler_lag):
            get_logger().info(
                "step %d: rank %d (host %s) is a straggler: %.3f s of compute per step, "
                "%.0f%% over the median of its peers (ranks %s)",
                step,
                rank,
                self.hosts[rank],
                compute[rank],
                100 * excess,
                [r for r, p in enumerate(peers) if p == peers[rank] and r != rank],
            )
        return host_metrics(self.hosts, figures)


def _hosts() -> list[str]:
    """Every rank's node (SLURM's node name where there is one), indexed by rank."""
    mine = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, mine)
    return hosts
