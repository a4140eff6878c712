"""PipeDream-2BW against synchronous training (what 1F1B computes) on the tiny recipe.

Both runs train the shipped `tiny` recipe (1.8M parameters, 128-token sequences, 16 per
step, AdamW at a 2e-3 peak with 20 warmup steps and cosine decay) in one process over the
real stage modules (`tests/pipedream_oracle.py`): synchronously, and under 2BW over
`--pp` stages, whose every gradient lands one step late. Prints the loss curve every
`--every` steps and the mean loss of the last 20 steps of each, with their ratio.

    python bench/pipedream_convergence.py [--steps 300] [--pp 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import pretrain.launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
from pretrain.core.schema import RecipeConfig, to_recipe
from tests.pipedream_oracle import pipedream_curve, synchronous_curve

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")
TAIL = 20


def load_recipe(steps: int, pp: int, overrides: list[str]) -> RecipeConfig:
    """The tiny recipe for one CPU process, with `steps` steps and a 2bw pipeline."""
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        node = compose(
            config_name="tiny",
            overrides=[
                "logging.wandb=disabled",
                f"train.steps={steps}",
                f"parallel.pp={pp}",
                "parallel.pp_schedule=2bw",
                *overrides,
            ],
        )
    return to_recipe(node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_recipe(args.steps, args.pp, args.overrides)
    start = time.perf_counter()
    synchronous = [loss for loss, _ in synchronous_curve(cfg, args.steps)]
    middle = time.perf_counter()
    two_bw = [loss for loss, _ in pipedream_curve(cfg, args.steps)]
    end = time.perf_counter()
    print(
        f"tiny recipe, {args.steps} steps, 2bw over pp={args.pp}, torch {torch.__version__}; "
        f"{middle - start:.0f} s synchronous, {end - middle:.0f} s 2bw\n"
    )
    print("| step | synchronous (1F1B) | 2BW | 2BW / synchronous |")
    print("| --- | --- | --- | --- |")
    for step in [*range(0, args.steps, args.every), args.steps - 1]:
        a, b = synchronous[step], two_bw[step]
        print(f"| {step + 1} | {a:.4f} | {b:.4f} | {b / a:.3f} |")
    final_sync = sum(synchronous[-TAIL:]) / TAIL
    final_2bw = sum(two_bw[-TAIL:]) / TAIL
    print(
        f"| last {TAIL} steps, mean | {final_sync:.4f} | {final_2bw:.4f} "
        f"| {final_2bw / final_sync:.3f} |"
    )


if __name__ == "__main__":
    main()
