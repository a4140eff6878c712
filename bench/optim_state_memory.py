"""Optimizer-state bytes per parameter for each `optim.state_dtype`, measured beside the plan.

For AdamW and Muon and each state dtype: build the model of a recipe in one CPU process,
take one optimizer step on random gradients, and add up the bytes of every tensor the
optimizer keeps (codes, block scales, step counts; the shared code maps excluded). The
planner's figure is launcher/plan/memory.py's `optimizer_states` for the same recipe on one rank.

    python bench/optim_state_memory.py [--recipe tiny] [key=value ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import pretrain.launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
from pretrain.core.layout import resolve_degrees
from pretrain.core.optim_states import STATE_DTYPES
from pretrain.core.schema import RecipeConfig, to_recipe
from pretrain.launcher.plan.memory import memory_breakdown
from pretrain.models import build
from pretrain.models.init import init_weights
from pretrain.trainer.optim.optimizers import build_optimizer
from pretrain.trainer.optim.states import StoredStateOptimizer

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")


def load_recipe(name: str, overrides: list[str]) -> RecipeConfig:
    """Compose a shipped recipe for one CPU process."""
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        node = compose(
            config_name=name,
            overrides=["cluster.gpus_per_node=1", "logging.wandb=disabled", *overrides],
        )
    return to_recipe(node)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor state the optimizer holds."""
    if isinstance(optimizer, StoredStateOptimizer):
        return optimizer.state_nbytes()
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def measured(cfg: RecipeConfig) -> float:
    """Optimizer-state bytes per parameter after one step."""
    model = build(cfg.model)
    init_weights(model, seed=0)
    optimizer = build_optimizer(model, cfg.optim, global_batch=1, device=torch.device("cpu"))
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    return state_nbytes(optimizer) / sum(p.numel() for p in model.parameters())


def planned(cfg: RecipeConfig) -> float:
    """The memory model's optimizer-state bytes per parameter."""
    breakdown = memory_breakdown(cfg, resolve_degrees(cfg), microbatches=1)
    return breakdown.optimizer_states / sum(p.numel() for p in build(cfg.model).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print("| optimizer | state dtype | measured B/param | planned B/param | measured / planned |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("adamw", "muon"):
        for dtype in STATE_DTYPES:
            extra = [f"optim.name={name}", f"optim.state_dtype={dtype}"]
            cfg = load_recipe(args.recipe, [*args.overrides, *extra])
            ours, plan = measured(cfg), planned(cfg)
            print(f"| {name} | {dtype} | {ours:.3f} | {plan:.3f} | {ours / plan:.3f} |")


if __name__ == "__main__":
    main()
