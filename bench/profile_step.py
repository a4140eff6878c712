"""Where a trainer step's time goes: torch.profiler over a few steps, top ops by CPU time.

python -m bench.profile_step [--compile] [--steps 10] [key=value ...]   (from the repo root)
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.step_overhead import load_recipe
from pretrain.core.layout import resolve_degrees
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.data.loader import one_process_loader
from pretrain.trainer.dist import init_distributed
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compile_override = f"compile.enabled={str(args.compile).lower()}"
    cfg = load_recipe(args.recipe, [compile_override, *args.overrides])
    rank = init_distributed(cfg.cluster)
    degrees = resolve_degrees(cfg)
    state = build_train_state(cfg, build_mesh(degrees, rank.device.type), rank.device)
    loader = one_process_loader(cfg)
    for _ in range(3):  # compile and warm up outside the profile
        train_step(StepContext(state, cfg, degrees, rank.device), loader.next_step())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            train_step(StepContext(state, cfg, degrees, rank.device), loader.next_step())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
