"""The only Hydra settings a command line may give: which sweeper runs a sweep, and a few
of the Optuna sweeper's settings, each allowed by name and checked here.

Everything else under `hydra` stays refused (launcher/compose/command_line.py): callbacks,
launchers, search paths, output dirs, an Optuna storage URL (a database file written elsewhere), a
custom search-space callable or sampler `_target_` (code to run). The search space itself
is given as ordinary overrides with -m: `optim.lr=interval(1e-4,1e-2)`,
`train.micro_batch=choice(2,4)`, `optim.weight_decay=range(0,0.2,step=0.05)`.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from pretrain.core.problems import Problem
from pretrain.launcher.compose.recipe_files import unknown_option

SWEEPERS = ("basic", "optuna")
"""`hydra/sweeper=NAME`: Hydra's own, or Optuna's (`pip install hydra-optuna-sweeper`)."""
SAMPLERS = ("tpe", "random", "cmaes", "nsgaii", "motpe", "grid")
"""`hydra/sweeper/sampler=NAME` of the Optuna sweeper."""
DIRECTIONS = ("minimize", "maximize")
SETTINGS = {
    "hydra.sweeper.n_trials": "trials in all",
    "hydra.sweeper.n_jobs": "trials per batch (the points of a batch run one after another)",
    "hydra.sweeper.direction": "minimize (the final loss) or maximize",
    "hydra.sweeper.sampler.seed": "the sampler's seed",
}
"""The Optuna sweeper's settings a command line may set, and what each is."""
_GROUPS = {"hydra/sweeper": SWEEPERS, "hydra/sweeper/sampler": SAMPLERS}


def is_sweeper_setting(key: str) -> bool:
    """Whether `key` is one of the Hydra settings allowed by name."""
    return key in _GROUPS or key in SETTINGS


def sweeper_problems(override: Any, multirun: bool) -> list[Problem]:
    """The problems of one allowed sweeper override (a parsed Hydra override)."""
    key = override.key_or_group
    value = None if override.is_delete() else override.value()
    if not multirun:
        return [Problem(key, value, "a sweeper setting only matters in a sweep", "add -m")]
    if override.is_delete() or override.is_add() or override.is_sweep_override():
        return [Problem(key, value, "a sweeper setting takes one value", f"write {key}=VALUE")]
    if key in _GROUPS:
        if value not in _GROUPS[key]:
            return [unknown_option(key, value, list(_GROUPS[key]))]
        if value == "optuna" and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper"):
            return []
        if value == "optuna":
            reason = "the Optuna sweeper is not installed"
            return [Problem(key, value, reason, "pip install hydra-optuna-sweeper")]
        return []
    if key == "hydra.sweeper.direction":
        if value not in DIRECTIONS:
            return [unknown_option(key, value, list(DIRECTIONS))]
        return []
    if isinstance(value, bool) or not isinstance(value, int):
        return [Problem(key, value, "not a whole number", f"give {SETTINGS[key]} as a number")]
    least = 0 if key.endswith("seed") else 1
    if value < least:
        return [Problem(key, value, f"must be at least {least}", f"use {least} or more")]
    return []


MAX_SWEEP_POINTS = 64
"""Points a sweep may have without `--yes` (each point is composed, validated and run)."""
MAX_SWEEP_POINTS_CONFIRMED = 10_000
"""Points a sweep may have at all, with `--yes`."""
CONFIRM_FLAG = "--yes"


def values_count(value: Any) -> int | None:
    """How many values a parsed sweep override takes (a choice, or a range counted by
    arithmetic, never by enumerating it); None for an interval (Optuna picks its trials)."""
    if hasattr(value, "list"):
        return len(value.list)
    if all(hasattr(value, name) for name in ("start", "stop", "step")):
        start, stop, step = value.start, value.stop, value.step or 1
        return max(0, math.ceil((stop - start) / step)) if math.isfinite(step) else 1
    return None


def points_problem(counts: list[int | None], trials: int | None, confirmed: bool) -> Problem | None:
    """A sweep of too many points: the product of `counts` (the basic sweeper), or Optuna's
    `trials`, above MAX_SWEEP_POINTS without `--yes`, or above MAX_SWEEP_POINTS_CONFIRMED."""
    if any(c is None for c in counts):
        points, field = trials, "hydra.sweeper.n_trials"
    else:
        points, field = math.prod(c for c in counts if c is not None), "-m"
    if points is None or points <= MAX_SWEEP_POINTS:
        return None
    value = f"{points:,} points"
    if points > MAX_SWEEP_POINTS_CONFIRMED:
        reason = f"more than the {MAX_SWEEP_POINTS_CONFIRMED:,} points a sweep may have"
        return Problem(field, value, reason, "narrow the values, or split it into sweeps")
    if confirmed:
        return None
    reason = f"more than {MAX_SWEEP_POINTS} points, each composed, validated and run"
    fix = f"add {CONFIRM_FLAG} to run them all, or narrow the values"
    return Problem(field, value, reason, fix)
