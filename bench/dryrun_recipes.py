"""Dry-run every shipped recipe (and the Llama 3 405B layout the search picks on 16,384
H100) at its layout, under fake collectives and fake tensors, and print the plan beside the
measurement: rank, plan GiB, dry-run GiB, plan / dry run, the step's collective bytes per
kind (the cost model's, `launcher/plan/comm/traffic.py`, and the dry run's) and seconds.

    python bench/dryrun_recipes.py [RECIPE ...]

Each rank's step runs the micro-batches `action=dryrun` runs (`measured_recipe`: two per
rank, a pipeline one per stage at least), and the plan is that of the same count.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

import pretrain.launcher.cli  # noqa: E402,F401  (registers the recipe schema with Hydra)
from pretrain.core.hardware import GIB  # noqa: E402
from pretrain.core.problems import RecipeError  # noqa: E402
from pretrain.core.schema import RecipeConfig, to_recipe  # noqa: E402
from pretrain.launcher.plan.dryrun import (  # noqa: E402
    MIB,
    DryRunError,
    chosen_rank,
    comparisons,
    measured_recipe,
    rank_plan,
    run_dry_run,
    traffic_comparisons,
)
from pretrain.launcher.plan.plan import make_plan  # noqa: E402
from pretrain.launcher.validate.recipe import validate  # noqa: E402

RECIPES = ("gpt2_124m", "llama3_1b", "llama3_8b", "llama3_70b", "mixtral_8x7b", "deepseek_v2_lite")
LLAMA3_405B = [
    "model=llama3_70b", "model.dim=16384", "model.n_layers=126", "model.n_heads=128",
    "model.ffn_dim=53248", "model.rope_theta=500000", "parallel.tp=8", "parallel.pp=16",
    "parallel.pp_layers=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]", "cluster.nodes=2048",
    "train.global_batch=2048",
]  # fmt: skip
"""The 405B layout of tests/unit/test_published_layouts.py (TP8 PP16 DP128, 16,384 H100):
126 layers in 16 stages, the first and the last lighter, as the search and validation
propose."""


def recipe(name: str, overrides: list[str]) -> RecipeConfig:
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        return to_recipe(compose(config_name=name, overrides=overrides))


def row(label: str, cfg: RecipeConfig, unit: float = GIB) -> tuple[str, str]:
    """The table's row for `cfg`, and the plan beside the dry run by category, on one line
    (figures in `unit` bytes: GiB, or MiB for small models)."""
    start = time.monotonic()
    try:
        validate(cfg)  # the plan and the dry run assume a layout validation accepts
    except RecipeError as err:
        return f"| {label} | | | | | {err} | |", ""
    rank, cfg = chosen_rank(cfg), measured_recipe(cfg)
    plan = rank_plan(cfg, make_plan(cfg), rank)
    try:
        result = run_dry_run(cfg, rank)
    except DryRunError as err:
        return f"| {label} | {rank} | | | | {err.reason} | {time.monotonic() - start:.0f} |", ""
    figures = comparisons(plan, result)
    peak = figures[-1]
    sent = ", ".join(
        f"{c.name} {c.plan_bytes / unit:.2f} / {c.measured_bytes / unit:.2f}"
        for c in traffic_comparisons(cfg, result)
        if c.measured_bytes >= MIB  # the rest: the step's scalars, a few KB
    )
    categories = "; ".join(
        f"{c.name} {c.plan_bytes / unit:.2f} vs {c.measured_bytes / unit:.2f}" for c in figures[:-1]
    )
    assert plan.memory is not None
    temps = sum(result["peak"].get(key, 0) for key in ("Temp", "Other", "Buffer"))
    categories += (
        f"; transients at peak {plan.memory.transients / unit:.2f} vs {temps / unit:.2f} "
        f"(temporaries, buffers, other); plan's peak phase {plan.memory.peak_phase}"
    )
    line = (
        f"| {label} | {rank} | {peak.plan_bytes / unit:.2f} | {peak.measured_bytes / unit:.2f} "
        f"| {peak.ratio:.2f} | {sent} | {time.monotonic() - start:.0f} |"
    )
    name = "GiB" if unit == GIB else "MiB"
    return line, f"{label} ({name}, plan vs dry run): {categories}"


def print_table(first: str, layouts: Iterable[tuple[str, RecipeConfig]], unit: float = GIB) -> None:
    """The table of `row`s of `layouts` (label, recipe), the first column headed `first`,
    then each layout's figures by category."""
    name = "GiB" if unit == GIB else "MiB"
    print(
        f"| {first} | rank | plan {name} | dry-run {name} | plan / dry run "
        f"| collectives of the step, {name} handed in (plan / dry run) | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    details = []
    for label, cfg in layouts:
        line, detail = row(label, cfg, unit)
        print(line, flush=True)
        details.append(detail)
    print()
    print("\n".join(d for d in details if d))


def shipped(name: str) -> RecipeConfig:
    """Recipe `name` as shipped, or the 405B layout; deepseek_v3 in bf16."""
    if name == "llama3_405b":
        return recipe("llama3_70b", LLAMA3_405B)
    if name == "deepseek_v3":
        # Its block FP8 runs torchao's triton kernels, which a CPU has not: bf16 stands in.
        return recipe(name, ["precision=bf16"])
    return recipe(name, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=[*RECIPES, "deepseek_v3", "llama3_405b"])
    args = parser.parse_args()
    # A generator: each recipe is composed as its row is due.
    print_table("recipe or layout", ((name, shipped(name)) for name in args.recipes))


if __name__ == "__main__":
    main()
