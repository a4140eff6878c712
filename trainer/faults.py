"""What goes wrong in a long run, seen by every rank together: non-finite steps, a request
to stop (preemption, time limit), stragglers, and test-only fault injection.

Fault injection (for tests and drills) comes from environment variables of the ranks:
- PRETRAIN_FAULT_NAN_STEPS=5,6: rank 0's loss is NaN at those steps (1-based), so its
  gradients and the global gradient norm are too;
- PRETRAIN_FAULT_KILL=RANK:STEP: that rank kills itself (SIGKILL) after that step, in the
  first attempt only (TORCHELASTIC_RESTART_COUNT=0), so a restarted group runs through;
- PRETRAIN_FAULT_HANG=RANK:STEP: that rank stops responding after that step, so the others
  wait in a collective until faults.collective_timeout_s;
- PRETRAIN_FAULT_CRASH_IN_SAVE=6: rank 0 dies after writing the checkpoint of step 6 but
  before marking it complete (see trainer/checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from pretrain_core.rundir import PREEMPTED_MARKER

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TooManyBadSteps(RuntimeError):
    """Consecutive steps with a non-finite loss or gradient norm exceeded the limit."""


def nan_steps() -> frozenset[int]:
    """Steps whose loss is poisoned with NaN on rank 0 (PRETRAIN_FAULT_NAN_STEPS)."""
    raw = os.environ.get("PRETRAIN_FAULT_NAN_STEPS", "")
    return frozenset(int(s) for s in raw.split(",") if s.strip())


def inject_rank_faults(rank: int, step: int) -> None:
    """Kill (PRETRAIN_FAULT_KILL, first attempt only) or hang (PRETRAIN_FAULT_HANG) this rank
    if the variable names this rank and step."""
    here = f"{rank}:{step}"
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ.get("PRETRAIN_FAULT_KILL") == here:
        print(f"[fault] rank {rank} kills itself after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("PRETRAIN_FAULT_HANG") == here:
        print(f"[fault] rank {rank} hangs after step {step}", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun can still end it
        while True:
            time.sleep(3600)


class StepGuard:
    """One all-reduce per step agrees on two flags across all ranks: whether any rank saw a
    non-finite loss or gradient norm (the step is skipped) and whether any rank was asked
    to stop (every rank finishes the step, then the job saves and exits)."""

    def __init__(self, max_bad_steps: int, device: torch.device) -> None:
        self.max_bad_steps = max_bad_steps
        self.device = device
        self.skipped = 0
        self._bad_in_a_row = 0
        self._signal: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def stop_requested(self) -> bool:
        """Whether this rank received SIGTERM or SIGUSR1 (`agree` tells every rank)."""
        return self._signal is not None

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(bad, stop) as every rank sees it: bad when any rank's loss or the norm is not
        finite, stop when any rank received SIGTERM or SIGUSR1."""
        bad = not (torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())
        flags = torch.tensor([float(bad), float(self._signal is not None)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())

    def record(self, step: int, bad: bool) -> None:
        """Count a skipped step; raise TooManyBadSteps after `max_bad_steps` in a row."""
        if not bad:
            self._bad_in_a_row = 0
            return
        self.skipped += 1
        self._bad_in_a_row += 1
        if dist.get_rank() == 0:
            print(f"[trainer] step {step}: non-finite loss or gradient norm; skipped", flush=True)
        if self._bad_in_a_row >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"step {step}: {self._bad_in_a_row} consecutive steps with a non-finite loss or "
                f"gradient norm (faults.max_bad_steps={self.max_bad_steps}); stopping without "
                "saving. Resume from the last checkpoint with a lower optim.lr or more warmup"
            )


def slowest_rank(step_times: list[float], lag: float) -> tuple[int, float] | None:
    """(rank, its lag over the median) of the slowest rank when it is more than `lag`
    (a fraction) slower than the median step time; None otherwise."""
    median = statistics.median(step_times)
    rank = max(range(len(step_times)), key=step_times.__getitem__)
    excess = step_times[rank] / median - 1 if median > 0 else 0.0
    return (rank, excess) if excess > lag else None


def gather_step_times(mean_step_s: float, device: torch.device) -> list[float]:
    """Every rank's mean step time of the last logging window, indexed by rank."""
    mine = torch.tensor([mean_step_s], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_single(every, mine)
    return every.tolist()


def mark_preempted(run_dir: Path, step: int) -> None:
    """Leave the marker the job script requeues on (rank 0 only)."""
    (Path(run_dir) / PREEMPTED_MARKER).write_text(f"{step}\n")


def clear_preempted(run_dir: Path) -> None:
    """Forget a marker from an earlier stop: this run is the resumed one."""
    (Path(run_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
