"""What goes wrong in a long run, seen by every rank together: non-finite steps, a request
to stop (preemption, time limit) and stragglers. Test-only fault injection is
`trainer/faults/injection.py`.
"""

from __future__ import annotations

import signal
import statistics
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from pretrain.core.run.rundir import PREEMPTED_MARKER
from pretrain.core.schema import FaultConfig
from pretrain.trainer.faults.policies import SpikeRule
from pretrain.trainer.log import get_logger
from pretrain.trainer.observe.stability import Alert

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
    """A bad step ended the run: `faults.max_bad_steps` skipped in a row, or one under the
    policy halt."""


class StepGuard:
    """One all-reduce per step agrees on what every rank must do alike: whether any rank saw
    a non-finite loss or gradient norm, whether the step's loss (averaged over the ranks) is
    a spike, and whether any rank was asked to stop (every rank finishes the step, then the
    job saves and exits). A bad step (non-finite, or a spike the policy acts on) applies no
    update; `record` then says what the policy does with it."""

    def __init__(
        self,
        max_bad_steps: int,
        device: torch.device,
        faults: FaultConfig | None = None,
    ) -> None:
        faults = faults or FaultConfig(max_bad_steps=max_bad_steps)
        self.max_bad_steps = max_bad_steps
        self.device = device
        self.on_nan, self.on_spike = faults.on_nan, faults.on_spike
        self.on_alert = faults.on_alert
        self.spikes = SpikeRule(faults.spike_factor, faults.spike_window)
        self.skipped = 0
        self.trigger = ""
        """Why the step just agreed on is bad: nan, spike, alert, or empty."""
        self.detail = ""
        self.audit: Callable[[dict[str, Any]], None] = lambda record: None
        """Told of every skip and halt (`trainer/faults/recovery.py` audits them)."""
        self._bad_in_a_row = 0
        install_stop_handlers()

    def stop_requested(self) -> bool:
        """Whether this rank received SIGTERM or SIGUSR1 (`agree` tells every rank)."""
        return stop_requested()

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(bad, stop) as every rank sees it: bad when any rank's loss or the norm is not
        finite or the mean loss is a spike `on_spike` acts on, stop when any rank received
        SIGTERM or SIGUSR1."""
        finite = bool(torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())
        mine = [float(not finite), float(stop_requested()), loss.item() if finite else 0.0]
        # One sum: flags count the ranks that raised them; every rank gets the same total.
        flags = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(flags)
        nonfinite, stop = bool(flags[0].item() > 0), bool(flags[1].item() > 0)
        self.trigger = self.detail = ""
        if nonfinite:
            self.trigger = "nan"
        elif self.on_spike != "none":
            mean = flags[2].item() / dist.get_world_size()
            median = self.spikes.median()
            if self.spikes.is_spike(mean):
                self.trigger = "spike"
                self.detail = (
                    f"loss {mean:.4g} > {self.spikes.factor:g} x {median:.4g}, the median of "
                    f"the last {self.spikes.losses.maxlen} steps"
                )
        return bool(self.trigger), stop

    def record(self, step: int, bad: bool) -> str:
        """What the policy does with `step`: "" (a good step), "skip" or "rollback"; raises
        TooManyBadSteps under halt, or after `max_bad_steps` skipped in a row."""
        if not bad:
            self._bad_in_a_row = 0
            return ""
        trigger = self.trigger or "nan"  # a stepper that agrees on its own sees only these
        policy = self.on_spike if trigger == "spike" else self.on_nan
        what = self.detail or "non-finite loss or gradient norm"
        if policy != "rollback":
            self.audit({"step": step, "trigger": trigger, "action": policy, "detail": what})
        if policy == "halt":
            raise TooManyBadSteps(
                f"step {step}: {what} (faults.on_{trigger}=halt); stopping without saving it. "
                "Resume from the last checkpoint with a lower optim.lr or more warmup, or set "
                f"faults.on_{trigger}=skip or rollback"
            )
        if policy == "rollback":
            return "rollback"
        self.skipped += 1
        self._bad_in_a_row += 1
        get_logger().info("step %d: %s; skipped", step, what)
        if self._bad_in_a_row >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"step {step}: {self._bad_in_a_row} consecutive steps with a non-finite loss or "
                f"gradient norm or a loss spike (faults.max_bad_steps={self.max_bad_steps}); "
                "stopping without saving. Resume from the last checkpoint with a lower optim.lr "
                "or more warmup"
            )
        return "skip"

    def alerted(self, step: int, alerts: list[Alert]) -> str:
        """What `faults.on_alert` does with the stability monitors' `alerts` of a good step
        (the same on every rank: the monitors are summed over the world): "" (none, or no
        alert) or "rollback"; raises TooManyBadSteps under halt."""
        if not alerts or self.on_alert == "none":
            return ""
        self.trigger = "alert"
        self.detail = "; ".join(a.line().removeprefix(f"step {step}: ") for a in alerts)
        if self.on_alert == "halt":
            self.audit({"step": step, "trigger": "alert", "action": "halt", "detail": self.detail})
            raise TooManyBadSteps(
                f"step {step}: {self.detail} (faults.on_alert=halt); stopping without saving "
                "it. Resume from the last checkpoint with a lower optim.lr, or set "
                "faults.on_alert=rollback or none"
            )
        return "rollback"


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


def gather_compute(
    compute_s: float, peers: int, device: torch.device, extra: list[float] = ()
) -> tuple[list[float], list[int], list[list[float]]]:
    """Every rank's mean compute seconds per step of the last logging window, its peer
    group and its `extra` figures (the same count on every rank), indexed by rank."""
    width = 2 + len(extra)
    mine = torch.tensor([compute_s, float(peers), *extra], dtype=torch.float64, device=device)
    every = torch.empty(width * dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_single(every, mine)
    values = every.view(-1, width).tolist()
    return [v[0] for v in values], [int(v[1]) for v in values], [v[2:] for v in values]


def mark_preempted(run_dir: Path, step: int) -> None:
    """Leave the marker the job script requeues on (rank 0 only)."""
    (Path(run_dir) / PREEMPTED_MARKER).write_text(f"{step}\n")


def clear_preempted(run_dir: Path) -> None:
    """Forget a marker from an earlier stop: this run is the resumed one."""
    (Path(run_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
