"""Rules of the logging fields: W&B names, group, job type and tags within W&B's limits,
TensorBoard and W&B only where their packages are installed, and the stability monitors'
rate and alert thresholds."""

from __future__ import annotations

import re

from pretrain.core.problems import Checks, install_fix, installed
from pretrain.core.schema import STABILITY_ALERTS, RecipeConfig

MAX_WANDB_TEXT = 128
"""W&B keeps group and job_type names up to 128 characters."""
MAX_WANDB_TAG = 64
"""W&B refuses tags longer than 64 characters."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_logging(c: Checks, cfg: RecipeConfig) -> None:
    """logging.wandb_{name,group,job_type,tags}, logging.tensorboard and
    logging.system_every_s."""
    g = cfg.logging
    c.at_least("logging.system_every_s", g.system_every_s, 0)
    for name in ("wandb_name", "wandb_group", "wandb_job_type"):
        value = getattr(g, name)
        if len(value) > MAX_WANDB_TEXT or _CONTROL.search(value):
            c.add(f"logging.{name}", value,
                  f"W&B takes up to {MAX_WANDB_TEXT} characters on one line",
                  "shorten it and drop line breaks")  # fmt: skip
    if not g.wandb_job_type:
        c.add("logging.wandb_job_type", "", "W&B needs a job type to filter by",
              "use train (the default)")  # fmt: skip
    for i, tag in enumerate(g.wandb_tags):
        if not tag or len(tag) > MAX_WANDB_TAG or _CONTROL.search(tag):
            c.add(f"logging.wandb_tags[{i}]", tag,
                  f"a W&B tag is 1 to {MAX_WANDB_TAG} characters on one line",
                  "shorten it, or remove it")  # fmt: skip
    if g.tensorboard and not installed("tensorboard"):
        c.add("logging.tensorboard", True, "the tensorboard package is not installed",
              f"{install_fix('tensorboard')}, or set logging.tensorboard=false")  # fmt: skip
    if g.wandb in ("online", "offline") and not installed("wandb"):
        c.add("logging.wandb", g.wandb, "the wandb package is not installed",
              f"{install_fix('wandb')}, or logging.wandb=auto (off where wandb is missing) "
              "or disabled")  # fmt: skip


def check_stability(c: Checks, cfg: RecipeConfig) -> None:
    """logging.stability_every and the monitors' alert thresholds."""
    g = cfg.logging
    c.at_least("logging.stability_every", g.stability_every, 0)
    for name, threshold in g.stability_alerts.items():
        at = f"logging.stability_alerts.{name}"
        if name not in STABILITY_ALERTS:
            c.add(at, threshold, "no such monitor raises alerts",
                  f"use one of {', '.join(STABILITY_ALERTS)}")  # fmt: skip
        elif not threshold >= 0:
            c.add(at, threshold, "a threshold is a value the monitor may not exceed",
                  "use a positive value, or 0 to turn the alert off")  # fmt: skip
