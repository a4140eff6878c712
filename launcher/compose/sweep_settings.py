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
from typing import Any

from launcher.compose.recipe_files import unknown_option
from pretrain_core.problems import Problem

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
