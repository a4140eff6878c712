"""The trainer's step against a plain PyTorch loop: same model, batch and optimizer.

In this one process: (a) a plain eager loop written here, (b) the trainer's step with compile
off and (c) with compile on (per block and the loss), on the same micro-batches, interleaved
in blocks of steps (the order rotates each round) so that machine noise hits all alike; the
medians of their per-step times are compared as throughput ratios against (a). Then the data
loader alone: sequences per second it delivers versus what the trainer consumes.

    python bench/step_overhead.py [--recipe tiny] [--rounds 7] [key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import pretrain.launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
from pretrain.core.layout import resolve_degrees
from pretrain.core.schema import RecipeConfig, to_recipe
from pretrain.models import build
from pretrain.models.init import init_weights
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.data.loader import RunData, open_datasets, packed_data, train_loader
from pretrain.trainer.data.prefetch import PrefetchingLoader
from pretrain.trainer.dist import init_distributed
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import train_step
from pretrain.trainer.step.phases import OFF, StepPhases

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")


def load_recipe(name: str, overrides: list[str]) -> RecipeConfig:
    """Compose a shipped recipe for one CPU process."""
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        node = compose(
            config_name=name,
            overrides=["cluster.gpus_per_node=1", "logging.wandb=disabled", *overrides],
        )
    return to_recipe(node)


def plain_loop_step(
    model, optimizer, micro_batches, grad_clip: float, phases: StepPhases = OFF
) -> None:
    """What a hand-written PyTorch training step does, nothing more (`phases` times it)."""
    for inputs, targets in micro_batches:
        with phases.phase("forward"):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with phases.phase("backward"):
            (loss / len(micro_batches)).backward()
    with phases.phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def plain_optimizer(model: torch.nn.Module, cfg: RecipeConfig) -> torch.optim.Optimizer:
    """AdamW (foreach) with the usual decay split, as a hand-written loop sets it up."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in named if p.ndim < 2 or "tok_embeddings" in n]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        foreach=True,
    )


def loader_rate(data: RunData, cfg: RecipeConfig, steps: int) -> float:
    """Sequences per second the loader delivers on its own (read, stack, split)."""
    loader = train_loader(cfg, data, dp_rank=0, dp_size=1)
    start = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    return steps * cfg.train.global_batch / (time.perf_counter() - start)


def interleaved_medians(
    runners: dict[str, Callable[[int], float]], warmup: int, rounds: int, steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per step of each runner and its spread (max - min over the median),
    over `rounds` rounds of `steps` steps in rotating order, after `warmup` steps each."""
    for run in runners.values():  # warm-up: allocator, thread pools, first-touch pages
        run(warmup)
    times: dict[str, list[float]] = {key: [] for key in runners}
    order = list(runners)
    for round_index in range(rounds):
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for key in rotated:
            times[key].append(runners[key](steps))
    median = {key: statistics.median(values) for key, values in times.items()}
    spread = {key: (max(v) - min(v)) / statistics.median(v) for key, v in times.items()}
    return median, spread


def print_report(
    cfg: RecipeConfig,
    args: argparse.Namespace,
    compile_s: float,
    median: dict[str, float],
    spread: dict[str, float],
    delivered: float,
    consumed: float,
) -> None:
    """The benchmark's lines: settings, each runner's median, the ratios, the loader's rate."""
    print(
        f"recipe {cfg.name}: {cfg.train.global_batch} x {cfg.train.seq_len} tokens per step, "
        f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds of "
        f"{args.steps_per_block} steps; first compiled step {compile_s:.1f} s"
    )
    labels = {
        "a": "(a) plain PyTorch loop",
        "b": "(b) trainer, compile off",
        "c": "(c) trainer, compile on",
    }
    for key, label in labels.items():
        print(
            f"{label:26s} {median[key] * 1e3:8.2f} ms/step (median; spread "
            f"{spread[key] * 100:4.1f}%)"
        )
    print(f"(b)/(a) throughput ratio: {median['a'] / median['b']:.3f}")
    print(f"(c)/(a) throughput ratio: {median['a'] / median['c']:.3f}")
    print(
        f"data loader alone: {delivered:,.0f} sequences/s; trainer consumes {consumed:,.0f} "
        f"sequences/s; ratio {delivered / consumed:,.0f}x"
    )


def step_breakdown(
    runners: dict[str, Callable[[int], float]],
    phases: dict[str, StepPhases],
    data_wait: dict[str, float],
    steps: int,
) -> dict[str, dict[str, float]]:
    """Seconds per step of each runner's regions (what the trainer logs as time_*_s) over
    one more block of `steps` steps each, with its data wait and whole step."""
    out = {}
    for key, run in runners.items():
        phases[key].take(1)
        data_wait[key] = 0.0
        step_s = run(steps)
        out[key] = {
            "time_data_wait_s": data_wait[key] / steps,
            **phases[key].take(steps),
            "step_s": step_s,
        }
    return out


def print_breakdown(breakdown: dict[str, dict[str, float]]) -> None:
    """One row per runner: ms per step in each region, and what no region covers."""
    columns = ("data_wait", "forward", "backward", "optimizer", "blocked")
    print("step breakdown, ms/step: " + " | ".join(columns) + " | outside regions | step")
    for key, row in breakdown.items():
        cells = [row.get(f"time_{c}_s", 0.0) * 1e3 for c in columns]
        outside = row["step_s"] * 1e3 - sum(cells[:4])
        text = " | ".join(f"{c:7.2f}" for c in cells)
        print(f"  ({key}) {text} | {outside:7.2f} | {row['step_s'] * 1e3:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_recipe(args.recipe, args.overrides)
    compiled_cfg = copy.deepcopy(cfg)
    compiled_cfg.compile.enabled = True
    rank = init_distributed(cfg.cluster)
    degrees = resolve_degrees(cfg)
    mesh = build_mesh(degrees, rank.device.type)
    data = packed_data(cfg, open_datasets(cfg, is_main=True, report=print))

    def new_loader():
        loader = train_loader(cfg, data, dp_rank=0, dp_size=1)
        if cfg.data.prefetch:
            return PrefetchingLoader(loader, depth=cfg.data.prefetch)
        return loader

    plain = build(cfg.model)
    init_weights(plain, cfg.seed)
    optimizer = plain_optimizer(plain, cfg)
    plain_batches = new_loader()

    phases = {key: StepPhases(rank.device) for key in "abc"}
    data_wait = dict.fromkeys("abc", 0.0)

    def plain_block(steps: int) -> float:
        batches = [plain_batches.next_step() for _ in range(steps)]
        start = time.perf_counter()
        for micro_batches in batches:
            plain_loop_step(plain, optimizer, micro_batches, cfg.optim.grad_clip, phases["a"])
        return (time.perf_counter() - start) / steps

    def trainer_runner(recipe: RecipeConfig, key: str) -> Callable[[int], float]:
        state = build_train_state(recipe, mesh, rank.device)
        state.phases = phases[key]  # as the trainer's setup does
        loader = new_loader()

        def block(steps: int) -> float:
            # The loader is inside the timed region, as in the trainer's loop.
            start = time.perf_counter()
            for _ in range(steps):
                wait = time.perf_counter()
                micro_batches = loader.next_step()
                data_wait[key] += time.perf_counter() - wait
                train_step(StepContext(state, recipe, degrees, rank.device), micro_batches)
            return (time.perf_counter() - start) / steps

        return block

    runners = {
        "a": plain_block,
        "b": trainer_runner(cfg, "b"),
        "c": trainer_runner(compiled_cfg, "c"),
    }
    start = time.perf_counter()
    runners["c"](1)  # compiles the blocks and the loss (forward and backward)
    compile_s = time.perf_counter() - start
    median, spread = interleaved_medians(
        runners, args.warmup_steps, args.rounds, args.steps_per_block
    )
    breakdown = step_breakdown(runners, phases, data_wait, args.steps_per_block)
    consumed = cfg.train.global_batch / median["b"]
    delivered = loader_rate(data, cfg, steps=200)

    print_report(cfg, args, compile_s, median, spread, delivered, consumed)
    print_breakdown(breakdown)


if __name__ == "__main__":
    main()
