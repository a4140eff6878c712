"""Short runs made to fit: a schedule longer than the run is shortened, with a warning.

`pretrain train.steps=5` is the first smoke test a newcomer types; refusing it because the
recipe's warmup is 20 steps helps nobody. The launcher shortens the warmup (and a decay
that no longer fits after it) to the run's length, says so, and writes the shortened
values to config.yaml, so the ranks train exactly what the warning says.
"""

from __future__ import annotations

from pretrain.core.schema import RecipeConfig


def fit_schedule_to_run(cfg: RecipeConfig) -> list[str]:
    """Shorten `cfg`'s warmup and decay to `train.steps` where they are longer; one warning
    per change. Values that are invalid on their own are left for the validator."""
    s, steps = cfg.schedule, cfg.train.steps
    if steps < 1 or s.warmup_steps < 0 or s.decay_steps < 0:
        return []
    warnings = []
    if s.warmup_steps > steps:
        warnings.append(
            f"schedule.warmup_steps={s.warmup_steps} is longer than train.steps={steps}; "
            f"warming up over all {steps} steps instead"
        )
        s.warmup_steps = steps
    if s.warmup_steps + s.decay_steps > steps:
        fitted = steps - s.warmup_steps
        warnings.append(
            f"schedule.warmup_steps + decay_steps = {s.warmup_steps + s.decay_steps} is longer "
            f"than train.steps={steps}; decaying over the remaining {fitted} steps instead"
        )
        s.decay_steps = fitted
    return warnings
