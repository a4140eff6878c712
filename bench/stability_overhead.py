"""What the stability monitors cost: the trainer's step with every step sampled against the
same step with none, in one process, interleaved in blocks of steps (the order rotating each
round, as `step_overhead.py` does); the medians' ratio is the cost of a sampled step, and
that over `logging.stability_every` is the cost at that rate. The step breakdown's
`time_stability_s` (the monitors' own time, as the trainer logs it) is printed beside it.

    python bench/stability_overhead.py [--recipe tiny] [--rounds 7] [--every 100] [key=value ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from step_overhead import interleaved_medians, load_recipe

from pretrain.core.layout import resolve_degrees
from pretrain.core.schema import STABILITY_ALERTS, RecipeConfig
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.data.loader import open_datasets, packed_data, train_loader
from pretrain.trainer.dist import init_distributed
from pretrain.trainer.observe.activation_probes import ActivationProbes
from pretrain.trainer.observe.stability import StabilityMonitor
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import train_step
from pretrain.trainer.step.phases import StepPhases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=100, help="the rate to report the cost at")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_recipe(args.recipe, args.overrides)
    rank = init_distributed(cfg.cluster)
    degrees = resolve_degrees(cfg)
    mesh = build_mesh(degrees, rank.device.type)
    data = packed_data(cfg, open_datasets(cfg, is_main=True, report=print))
    phases = {key: StepPhases(rank.device) for key in ("off", "sampled")}

    def runner(key: str, recipe: RecipeConfig) -> Callable[[int], float]:
        state = build_train_state(recipe, mesh, rank.device)
        state.phases = phases[key]
        if key == "sampled":
            probes = ActivationProbes([state.plain], cfg.model.n_layers, tp=1, sp=False,
                                      tp_group=None, device=rank.device,
                                      phases=state.phases)  # fmt: skip
            state.stability = StabilityMonitor(1, dict(STABILITY_ALERTS), probes,
                                               n_layers=cfg.model.n_layers, stage_ranks=1,
                                               device=rank.device,
                                               phases=state.phases)  # fmt: skip
        loader = train_loader(recipe, data, dp_rank=0, dp_size=1)
        ctx = StepContext(state, recipe, degrees, rank.device)
        step = 0

        def block(steps: int) -> float:
            nonlocal step
            batches = [loader.next_step() for _ in range(steps)]
            start = time.perf_counter()
            for micro_batches in batches:
                step += 1
                state.stability.arm(step)
                train_step(ctx, micro_batches)
                state.stability.collect(step)
            return (time.perf_counter() - start) / steps

        return block

    runners = {key: runner(key, cfg) for key in phases}
    median, spread = interleaved_medians(
        runners, args.warmup_steps, args.rounds, args.steps_per_block
    )
    for key in phases:
        phases[key].take(1)
    runners["sampled"](args.steps_per_block)
    own = phases["sampled"].take(args.steps_per_block).get("time_stability_s", 0.0)
    per_sampled = median["sampled"] / median["off"] - 1
    print(
        f"recipe {cfg.name}: {cfg.train.global_batch} x {cfg.train.seq_len} tokens per step, "
        f"{cfg.model.n_layers} layers, torch {torch.__version__}, {args.threads} threads, "
        f"{args.rounds} rounds of {args.steps_per_block} steps"
    )
    for key in phases:
        print(f"  {key:8s} {median[key] * 1e3:8.2f} ms/step (spread {spread[key] * 100:4.1f}%)")
    print(f"a sampled step costs {per_sampled * 100:+.2f}% (time_stability_s "
          f"{own * 1e3:.2f} ms, {own / median['off'] * 100:.2f}% of a step)")  # fmt: skip
    print(f"at logging.stability_every={args.every}: {per_sampled / args.every * 100:+.3f}% "
          f"of the step time")  # fmt: skip


if __name__ == "__main__":
    main()
