"""What goes wrong in a long run, seen by every rank together: non-finite steps, a request
to stop (preemption, time limit) and stragglers. Test-only fault injection is
`trainer/fault_injection.py`.
"""

from __future__ import annotations

import signal
import statistics
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from pretrain_core.rundir import PREEMPTED_MARKER
from trainer.log import get_logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TooManyBadSteps(RuntimeError):
    """Consecutive steps with a non-finite loss or gradient norm exceeded the limit."""


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
        get_logger().info("step %d: non-finite loss or gradient norm; skipped", step)
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
