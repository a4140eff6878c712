"""How a run shows up in W&B: its name, group, job type and tags, and the plan's predictions
beside the measurements (so a panel can put predicted and measured MFU, step time and memory
side by side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, read_mapping
from pretrain.core.layout import Degrees
from pretrain.core.run.rundir import PLAN_FILE
from pretrain.core.schema import RecipeConfig

PREDICTED = ("memory_gib", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction",
             "params_total", "flops_per_token_train")  # fmt: skip
"""The plan's numbers logged as `plan/NAME` in the W&B summary (and under `plan` in its
config); the measured ones are perf/*, mem/peak_gib."""


@dataclass(frozen=True)
class RunIdentity:
    """W&B's name, group, job_type and tags of a run, and the plan's predictions."""

    name: str
    group: str | None
    job_type: str
    tags: list[str]
    predicted: dict[str, Any] = field(default_factory=dict)


def layout_tag(degrees: Degrees, zero: int) -> str:
    """The layout as one short tag, e.g. tp2-pp1-dp2-zero2 (ep and cp when used)."""
    tag = f"tp{degrees.tp}-pp{degrees.pp}-dp{degrees.dp}-zero{zero}"
    return tag + (f"-ep{degrees.ep}" if degrees.ep > 1 else "")


def predicted(run_dir: Path) -> dict[str, Any]:
    """The plan's predictions of RUN_DIR/plan.json (those it made: None ones are left out)."""
    path = run_dir / PLAN_FILE
    try:
        plan = read_mapping(path, "the run's plan.json")
    except ReadError:
        return {}
    return {key: plan[key] for key in PREDICTED if plan.get(key) is not None}


def run_identity(cfg: RecipeConfig, run_dir: Path, degrees: Degrees) -> RunIdentity:
    """The run's W&B identity from logging.wandb_* (the launcher fills them for a sweep
    point) and the automatic tags: the recipe, the layout, the precision. A run on several
    nodes without a group gets the run dir's name as one, so that the runs holding the
    other nodes' system metrics sit beside it."""
    g = cfg.logging
    auto = [cfg.name, layout_tag(degrees, cfg.parallel.zero), cfg.precision.dtype]
    tags = list(dict.fromkeys([*auto, *g.wandb_tags]))
    return RunIdentity(
        name=g.wandb_name or cfg.name,
        group=g.wandb_group or (run_dir.name if cfg.cluster.nodes > 1 else None),
        job_type=g.wandb_job_type,
        tags=tags,
        predicted=predicted(run_dir),
    )
