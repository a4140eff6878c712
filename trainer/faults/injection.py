"""Test-only faults, read once from the ranks' environment by one `FaultInjector`.

- PRETRAIN_FAULT_NAN_STEPS=5,6: rank 0's loss is NaN on the batches of those steps (1-based,
  in the run's data order: after a rollback skipped data, the step that trains such a batch
  is another), so its gradients and the global gradient norm are too;
- PRETRAIN_FAULT_SPIKE_STEPS=5,6: rank 0's loss is SPIKE_SCALE times larger on the batches
  of those steps (as NaN's), and so are its gradients;
- PRETRAIN_FAULT_KILL=RANK:STEP: that rank kills itself (SIGKILL) after that step, in the
  first attempt only (TORCHELASTIC_RESTART_COUNT=0), so a restarted group runs through;
- PRETRAIN_FAULT_HANG=RANK:STEP: that rank stops responding after that step, so the others
  wait in a collective until the timeout in force (trainer/faults/timeouts.py);
- PRETRAIN_FAULT_SLOW_RANK=RANK:SECONDS: that rank's compute takes SECONDS longer in every
  step: its first loss computation of the step busy-waits that long, as a slow device
  computes (a sleep would be a wait, which the straggler detector rightly leaves out);
- PRETRAIN_FAULT_CRASH_IN_SAVE=6: rank 0 dies after writing the checkpoint of step 6 but
  before marking it complete (see trainer/checkpoint/checkpointer.py);
- PRETRAIN_FAULT_OOM=RANK:STEP: that rank raises the device's out-of-memory error after
  that step, as an allocation that does not fit would;
- PRETRAIN_FAULT_STOP=STEP: rank 0 receives SIGUSR1 as that step begins (as from SLURM
  before the time limit), so the job saves that step and stops.

PRETRAIN_FAULT_PREPARE_STOP=N stops a data preparation as SIGTERM would once N units are
done; `dataprep/prepare.py` reads it, since preparation runs without torch.

Nothing is injected when none of them is set, which is every real run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pretrain.trainer.log import get_logger

SPIKE_SCALE = 20.0
"""How much larger an injected spike makes rank 0's loss (and gradients)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rank_step(raw: str | None) -> tuple[int, int] | None:
    if not raw:
        return None
    rank, _, step = raw.partition(":")
    return int(rank), int(step)


def _rank_seconds(raw: str | None) -> tuple[int, float] | None:
    if not raw:
        return None
    rank, _, seconds = raw.partition(":")
    return int(rank), float(seconds)


def busy_wait(seconds: float) -> None:
    """Keep this thread computing for `seconds` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass
class FaultInjector:
    """The faults this rank was asked to inject, and the step it is on."""

    rank: int
    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    kill: tuple[int, int] | None = None
    hang: tuple[int, int] | None = None
    crash_in_save: int | None = None
    slow: tuple[int, float] | None = None
    oom: tuple[int, int] | None = None
    stop: int | None = None
    first_attempt: bool = True
    step: int = 0
    """The 1-based step being trained (set by `begin_step`)."""
    batch: int = 0
    """The 1-based step whose batch, in the run's data order, it trains."""
    _slowed_step: int = field(default=0, init=False, repr=False)

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ) -> FaultInjector:
        """The faults PRETRAIN_FAULT_* ask of `rank`."""
        raw_nan = environ.get("PRETRAIN_FAULT_NAN_STEPS", "")
        raw_spike = environ.get("PRETRAIN_FAULT_SPIKE_STEPS", "")
        crash = environ.get("PRETRAIN_FAULT_CRASH_IN_SAVE")
        stop = environ.get("PRETRAIN_FAULT_STOP")
        return cls(
            rank=rank,
            nan_steps=frozenset(int(s) for s in raw_nan.split(",") if s.strip()),
            spike_steps=frozenset(int(s) for s in raw_spike.split(",") if s.strip()),
            kill=_rank_step(environ.get("PRETRAIN_FAULT_KILL")),
            hang=_rank_step(environ.get("PRETRAIN_FAULT_HANG")),
            crash_in_save=int(crash) if crash else None,
            slow=_rank_seconds(environ.get("PRETRAIN_FAULT_SLOW_RANK")),
            oom=_rank_step(environ.get("PRETRAIN_FAULT_OOM")),
            stop=int(stop) if stop else None,
            first_attempt=environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0",
        )

    def begin_step(self, step: int, batch: int | None = None) -> None:
        """The loop starts training `step` (1-based) on the batch of step `batch` in the data
        order (`step` itself unless a rollback skipped data); rank 0 is asked to stop at the
        step PRETRAIN_FAULT_STOP names (the step's agreement tells every rank)."""
        self.step = step
        self.batch = step if batch is None else batch
        if self.rank == 0 and self.stop == step:
            get_logger().warning("fault: rank 0 is sent SIGUSR1 as step %d begins", step)
            os.kill(os.getpid(), signal.SIGUSR1)

    def wrap_loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn`, returning NaN (or a spike) on rank 0 on the batches PRETRAIN_FAULT_NAN_STEPS
        (PRETRAIN_FAULT_SPIKE_STEPS) names and computing longer on the rank
        PRETRAIN_FAULT_SLOW_RANK names."""
        nan = self.rank == 0 and bool(self.nan_steps | self.spike_steps)
        slow = self.slow is not None and self.slow[0] == self.rank
        if not (nan or slow):
            return loss_fn

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if slow and self._slowed_step != self.step:
                assert self.slow is not None
                self._slowed_step = self.step
                busy_wait(self.slow[1])
            value = loss_fn(logits, targets)
            if nan and self.batch in self.nan_steps:
                return value * float("nan")
            return value * SPIKE_SCALE if nan and self.batch in self.spike_steps else value

        return loss

    def after_step(self) -> None:
        """Kill this rank (first attempt only), hang it or run it out of memory, if asked
        for this step."""
        here = (self.rank, self.step)
        if self.oom == here:
            raise torch.OutOfMemoryError(
                f"fault: rank {self.rank} out of memory after step {self.step}. Tried to "
                "allocate 2.00 GiB (injected)"
            )
        if self.first_attempt and self.kill == here:
            get_logger().warning("fault: rank %d kills itself after step %d", *here)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang == here:
            get_logger().warning("fault: rank %d hangs after step %d", *here)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun can still end it
            while True:
                time.sleep(3600)

    def before_commit(self, step: int) -> None:
        """Die after a checkpoint's shards are written, before it is marked complete."""
        if self.crash_in_save == step:
            get_logger().warning("fault: crashing during the save of step %d", step)
            os._exit(13)
