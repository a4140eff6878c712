"""What a run dir says about its run, read for `pretrain diff`: the resolved config and the
plan as flat `field -> value` maps, the overrides, the ledger (core/run/ledger.py) and the
loss per logged step, each through the core's reading layer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import (
    MAX_LOG_BYTES,
    MissingFile,
    ReadError,
    integer,
    json_objects,
    mapping,
    number,
    read_json,
    read_yaml,
)
from pretrain.core.run.ledger import read_ledger
from pretrain.core.run.rundir import CONFIG_FILE, METRICS_FILE, OVERRIDES_FILE, PLAN_FILE

MAX_PLAN_BYTES = 64 << 20
"""Bound of plan.json read back (a plan with a long pipeline schedule is large)."""


@dataclass(frozen=True)
class RunRecord:
    """One run dir as `pretrain diff` compares it; None where the run dir lacks the file."""

    path: Path
    config: dict[str, Any]
    """config.yaml flattened: `optim.lr -> 0.001`."""
    recipe: str | None
    overrides: list[str] | None
    ledger: list[dict[str, Any]] | None
    plan: dict[str, Any] | None
    """plan.json flattened as the config is."""
    losses: dict[int, float | None] | None
    """Loss per logged step (None: logged as not finite); the last record of a step wins."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as `a.b.c -> leaf`; lists and empty mappings are leaves."""
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _overrides(run_dir: Path) -> tuple[str | None, list[str] | None]:
    """(the recipe's name, the command line's overrides) of overrides.yaml, or Nones."""
    path = run_dir / OVERRIDES_FILE
    expected = "the run's overrides.yaml (the recipe and the command line's overrides)"
    try:
        launched = mapping(read_yaml(path, expected), path, expected)
    except MissingFile:
        return None, None
    given = launched.get("overrides")
    if not isinstance(given, list) or not all(isinstance(o, str) for o in given):
        raise ReadError(
            path, "overrides is not a list of text", expected, "give the file the tool wrote"
        )
    recipe = launched.get("recipe")
    return (recipe if isinstance(recipe, str) else None), given


def _plan(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / PLAN_FILE
    expected = "the launcher's plan of the run (a JSON object)"
    try:
        return flatten(mapping(read_json(path, expected, MAX_PLAN_BYTES), path, expected))
    except MissingFile:
        return None


def losses(run_dir: Path) -> dict[int, float | None] | None:
    """Loss per logged step of RUN_DIR/metrics.jsonl, None without one; a line that is not
    a JSON object with a whole step and a loss (cut by a crash, an older format) is
    skipped."""
    path = run_dir / METRICS_FILE
    try:
        rows, _ = json_objects(
            path, "the run's metrics.jsonl (one JSON object per line)", MAX_LOG_BYTES
        )
    except MissingFile:
        return None
    found: dict[int, float | None] = {}
    for row in rows:
        try:
            step = integer(row.get("step"), path, "step")
        except ReadError:
            continue
        if step is not None and "loss" in row:
            found[step] = number(row["loss"])
    return dict(sorted(found.items()))


def read_run(run_dir: Path) -> RunRecord:
    """The run dir's record; a ReadError when it is no run dir (no readable config.yaml)."""
    path = Path(run_dir)
    if not path.is_dir():
        found = "no such directory" if not path.exists() else "not a directory"
        raise ReadError(path, found, "a run dir", "give the run.dir of a run `pretrain` wrote")
    config_path = path / CONFIG_FILE
    expected = "the run's config.yaml (a mapping of the recipe's fields)"
    try:
        config = mapping(read_yaml(config_path, expected), config_path, expected)
    except MissingFile:
        raise ReadError(
            path, f"no {CONFIG_FILE}", "a run dir", "give the run.dir of a run `pretrain` wrote"
        ) from None
    recipe, overrides = _overrides(path)
    ledger = read_ledger(path)
    return RunRecord(
        path=path.resolve(),
        config=flatten(config),
        recipe=recipe,
        overrides=overrides,
        ledger=None if ledger is None else ledger[0],
        plan=_plan(path),
        losses=losses(path),
    )
