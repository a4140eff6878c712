"""Learning-rate schedules as a factor of the peak lr, per 0-based optimizer step.

Conventions (one for every schedule):
- Warmup over W steps: factor (step + 1) / W, so step 0 already moves the weights and step
  W - 1 reaches the peak.
- Decay over D steps starting at step S: progress p = (step - S + 1) / D, so the last decay
  step (S + D - 1) uses exactly `min_ratio`; later steps stay there.
  cosine: min + (1 - min) * (1 + cos(pi * p)) / 2;  linear and wsd cooldown: 1 - (1 - min) * p.
- cosine/linear decay right after warmup (S = W) for D = decay_steps, or until the end of the
  run when decay_steps = 0. wsd holds the peak until the final cooldown of D = decay_steps
  (0 = 20% of the run), S = total_steps - D: only the cooldown depends on total_steps, so a run
  extended before its cooldown has the same lr at every step it already took.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from pretrain.core.schema import LR_SCHEDULES as SCHEDULES
from pretrain.core.schema import OptimConfig, ScheduleConfig


def _progress(step: int, start: int, length: int) -> float:
    """Fraction of a decay of `length` steps from `start` done after step `step`, in [0, 1]."""
    return min(max((step - start + 1) / max(length, 1), 0.0), 1.0)


def lr_factor(step: int, *, schedule: ScheduleConfig, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step` (see the module docstring)."""
    if schedule.name not in SCHEDULES:
        raise ValueError(f"schedule.name={schedule.name!r}: use {', '.join(SCHEDULES)}")
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.name == "constant":
        return 1.0
    if schedule.name == "wsd":
        cooldown = schedule.decay_steps or max(1, total_steps // 5)
        start = max(warmup, total_steps - cooldown)
        if step < start:
            return 1.0
        return 1.0 - (1.0 - min_ratio) * _progress(step, start, cooldown)
    decay = schedule.decay_steps or total_steps - warmup
    p = _progress(step, warmup, decay)
    if schedule.name == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_lr_scheduler(
    optimizer: Optimizer, optim: OptimConfig, schedule: ScheduleConfig, total_steps: int
) -> LambdaLR:
    """A LambdaLR over `lr_factor` with min_ratio = optim.min_lr / optim.lr.

    Call `scheduler.step()` after each `optimizer.step()`. Its state_dict holds only the step
    count and base lrs, so a resumed run follows the schedule of its current config (e.g. a
    longer `train.steps`), not the one saved in the checkpoint.
    """
    if optim.lr <= 0:
        raise ValueError(f"optim.lr={optim.lr} must be > 0")
    if schedule.warmup_steps < 0 or schedule.decay_steps < 0:
        raise ValueError("schedule.warmup_steps and schedule.decay_steps must be >= 0")
    if schedule.name not in SCHEDULES:
        raise ValueError(f"schedule.name={schedule.name!r}: use {', '.join(SCHEDULES)}")
    # A partial (not a callable object) so LambdaLR saves no schedule parameters in its state.
    factor = functools.partial(
        lr_factor, schedule=schedule, total_steps=total_steps, min_ratio=optim.min_lr / optim.lr
    )
    return LambdaLR(optimizer, factor)


def spread_over_groups(saved: dict[str, Any], groups: int) -> dict[str, Any]:
    """The LR scheduler's saved state for `groups` optimizer groups.

    How parameters split into groups depends on the layout (by DeviceMesh, and a pipeline
    stage holds only some parameters), while the schedule does not: every group has the
    same peak lr, so a saved group's entries stand for any group.
    """
    per_group = ("base_lrs", "_last_lr", "lr_lambdas")
    if len(saved["base_lrs"]) == groups:
        return saved
    for key in per_group:
        if key in saved and any(v != saved[key][0] for v in saved[key]):
            raise ValueError(
                f"the checkpoint's LR schedule differs between its {len(saved['base_lrs'])} "
                f"parameter groups ({key}={saved[key]}); it cannot be spread over {groups}"
            )
    return {**saved, **{k: [saved[k][0]] * groups for k in per_group if k in saved}}


class ScheduleState:
    """A Stateful over the LR schedule of `optimizer`, restored under any group count."""

    def __init__(self, scheduler: LRScheduler, optimizer: Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = self.optimizer.param_groups
        self.scheduler.load_state_dict(spread_over_groups(state_dict, len(groups)))
        # LambdaLR sets the groups' lr only when it steps: apply the restored one now.
        for group, lr in zip(groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
