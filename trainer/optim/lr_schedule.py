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

Under a batch-size ramp or sequence-length warm-up (`core/data_order/ramps.py`) the schedule runs by
tokens: the formulas above read the steps done through a step as the tokens trained through
it over a full step's (train.global_batch x train.seq_len), and the run's length as its
tokens over a full step's, so warmup_steps and decay_steps count full steps' worth of
tokens. Without a ramp every step is a full one: the same numbers as by steps. Under
`optim.lr_scaling` a ramp's smaller batches scale the rate by the same rule.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import LR_SCHEDULES as SCHEDULES
from pretrain.core.schema import OptimConfig, ScheduleConfig
from pretrain.trainer.optim.optimizers import scaled_lr


def _progress(done: float, start: float, length: float) -> float:
    """Fraction of a decay of `length` steps from `start` done once `done` steps are, in
    [0, 1]."""
    return min(max((done - start) / max(length, 1), 0.0), 1.0)


def lr_factor(step: int, *, schedule: ScheduleConfig, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step` (see the module docstring)."""
    return lr_factor_at(step + 1, schedule=schedule, total=total_steps, min_ratio=min_ratio)


def lr_factor_at(done: float, *, schedule: ScheduleConfig, total: float, min_ratio: float) -> float:
    """Multiplier of the peak lr for the step that brings the steps done to `done` (step + 1,
    or under a ramp its tokens over a full step's) in a run of `total`."""
    if schedule.name not in SCHEDULES:
        raise ValueError(f"schedule.name={schedule.name!r}: use {', '.join(SCHEDULES)}")
    warmup = schedule.warmup_steps
    if done <= warmup:
        return done / warmup
    if schedule.name == "constant":
        return 1.0
    if schedule.name == "wsd":
        cooldown = schedule.decay_steps or max(1, total // 5)
        start = max(warmup, total - cooldown)
        if done <= start:
            return 1.0
        return 1.0 - (1.0 - min_ratio) * _progress(done, start, cooldown)
    decay = schedule.decay_steps or total - warmup
    p = _progress(done, warmup, decay)
    if schedule.name == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def ramp_lr_factor(
    step: int,
    *,
    ramp: Ramp,
    schedule: ScheduleConfig,
    optim: OptimConfig,
    total_steps: int,
) -> float:
    """`lr_factor_at` by tokens for 0-based step `step` of a run under `ramp`, times the
    ratio `optim.lr_scaling` gives the step's global batch over the full one."""
    factor = lr_factor_at(
        ramp.full_steps(step + 1),
        schedule=schedule,
        total=ramp.full_steps(total_steps),
        min_ratio=optim.min_lr / optim.lr,
    )
    batch = ramp.phase(step).global_batch
    if optim.lr_scaling != "none" and batch != ramp.full_batch:
        factor *= scaled_lr(optim, batch) / scaled_lr(optim, ramp.full_batch)
    return factor


def build_lr_scheduler(
    optimizer: Optimizer,
    optim: OptimConfig,
    schedule: ScheduleConfig,
    total_steps: int,
    ramp: Ramp | None = None,
) -> LambdaLR:
    """A LambdaLR over `lr_factor` with min_ratio = optim.min_lr / optim.lr (by tokens,
    `ramp_lr_factor`, under an active `ramp`).

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
    if ramp is not None and ramp.active:
        by_tokens = functools.partial(
            ramp_lr_factor, ramp=ramp, schedule=schedule, optim=optim, total_steps=total_steps
        )
        return LambdaLR(optimizer, by_tokens)
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
