"""What goes wrong in a long run, seen by every rank together: non-finite steps, a request
to stop (preemption, time limit) and stragglers. Test-only fault injection is
`trainer/faults/injection.py`.
"""

from __future__ import annotations

import signal
import statistics
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from pretrain.core.run.rundir import PREEMPTED_MARKER
from pretrain.trainer.log import get_logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What SLURM sends before the time limit (SIGUSR1, see the sbatch template) and what clusters
send at preemption and on scancel (SIGTERM): both ask the ranks to finish the step and save."""

_stop_signal: int | None = None


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    global _stop_signal
    _stop_signal = signum


def install_stop_handlers() -> None:
    """Remember a stop signal instead of dying of it; called first thing on every rank, so a
    signal that arrives while the rank is still setting up stops it after its first step."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def stop_requested() -> bool:
    """Whether this rank received SIGTERM or SIGUSR1."""
    return _stop_signal is not None


def received_stop_signal() -> int | None:
    """The stop signal this rank received itself, if any."""
    return _stop_signal


def stop_signal_name() -> str:
    """The stop signal this rank received ("a peer's signal" when only another rank got one)."""
    return signal.Signals(_stop_signal).name if _stop_signal else "a peer's signal"


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
        install_stop_handlers()

    def stop_requested(self) -> bool:
        """Whether this rank received SIGTERM or SIGUSR1 (`agree` tells every rank)."""
        return stop_requested()

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(bad, stop) as every rank sees it: bad when any rank's loss or the norm is not
        finite, stop when any rank received SIGTERM or SIGUSR1."""
        bad = not (torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())
        flags = torch.tensor([float(bad), float(stop_requested())], device=self.device)
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


STRAGGLER_MIN_S = 0.05
"""Extra compute per step below which no rank is named: measuring a few milliseconds of
compute on a shared machine varies by about that much, and so little costs a step little."""


def slowest_rank(times: list[float], lag: float) -> tuple[int, float] | None:
    """(rank, its lag over the others' median) of the slowest of `times` (seconds per step)
    when it takes more than `lag` (a fraction) and more than STRAGGLER_MIN_S longer than the
    median of the others; None otherwise."""
    rank = max(range(len(times)), key=times.__getitem__)
    others = statistics.median(times[:rank] + times[rank + 1 :])
    excess = times[rank] / others - 1 if others > 0 else 0.0
    late = excess > lag and times[rank] - others > STRAGGLER_MIN_S
    return (rank, excess) if late else None


def stragglers(compute: list[float], peers: list[int], lag: float) -> list[tuple[int, float]]:
    """`slowest_rank` of each group of peers (ranks with the same `peers` value do the same
    work: one pipeline stage) as (rank, lag); groups of one rank are not compared."""
    found = []
    for group in sorted(set(peers)):
        ranks = [r for r, p in enumerate(peers) if p == group]
        if len(ranks) < 2:
            continue
        slow = slowest_rank([compute[r] for r in ranks], lag)
        if slow is not None:
            found.append((ranks[slow[0]], slow[1]))
    return found


def gather_compute(compute_s: float, peers: int, device: torch.device) -> tuple[list, list]:
    """Every rank's mean compute seconds per step of the last logging window and its peer
    group, indexed by rank."""
    mine = torch.tensor([compute_s, float(peers)], dtype=torch.float64, device=device)
    every = torch.empty(2 * dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_single(every, mine)
    values = every.view(-1, 2).tolist()
    return [v[0] for v in values], [int(v[1]) for v in values]


def mark_preempted(run_dir: Path, step: int) -> None:
    """Leave the marker the job script requeues on (rank 0 only)."""
    (Path(run_dir) / PREEMPTED_MARKER).write_text(f"{step}\n")


def clear_preempted(run_dir: Path) -> None:
    """Forget a marker from an earlier stop: this run is the resumed one."""
    (Path(run_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
