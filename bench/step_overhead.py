"""The trainer's step against a plain PyTorch loop: same model, batch and optimizer.

Both run in this one process on the same micro-batches, interleaved in blocks of steps so
that machine noise hits both alike; the medians of their per-step times are compared.
A ratio (trainer throughput / plain-loop throughput) of 1.00 means no overhead.

    python bench/step_overhead.py [--recipe tiny] [--blocks 7] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
from launcher.layout import resolve_degrees
from launcher.schema import RecipeConfig, to_recipe
from models import build
from models.init import init_weights
from parallel.mesh import build_mesh
from trainer.build import build_train_state
from trainer.data import DataLoader, GlobalBatchSampler, prepare_dataset
from trainer.dist import init_distributed
from trainer.train import train_step

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")


def load_recipe(name: str, overrides: list[str]) -> RecipeConfig:
    """Compose a shipped recipe for one CPU process."""
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        node = compose(
            config_name=name,
            overrides=["cluster.gpus_per_node=1", "logging.wandb=disabled", *overrides],
        )
    return to_recipe(node)


def plain_loop_step(model, optimizer, micro_batches, grad_clip: float) -> None:
    """What a hand-written PyTorch training step does, nothing more."""
    for inputs, targets in micro_batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_recipe(args.recipe, args.overrides)
    rank = init_distributed(cfg.cluster)
    degrees = resolve_degrees(cfg)
    mesh = build_mesh(degrees, rank.device.type)
    state = build_train_state(cfg, mesh, degrees, rank.device)
    dataset = prepare_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    sampler = GlobalBatchSampler(len(dataset), cfg.train.global_batch, cfg.seed)
    loader = DataLoader(dataset, sampler, dp_rank=0, dp_size=1, micro_batch=cfg.train.micro_batch)

    plain = build(cfg.model)
    init_weights(plain, cfg.seed)
    decay = [p for n, p in plain.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in plain.named_parameters() if p.ndim < 2 or "tok_embeddings" in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        foreach=True,
    )
    plain_batches = DataLoader(
        dataset, sampler, dp_rank=0, dp_size=1, micro_batch=cfg.train.micro_batch
    )

    def trainer_block() -> float:
        start = time.perf_counter()
        for _ in range(args.steps_per_block):
            train_step(state, loader.next_step(), cfg, degrees, rank.device)
        return (time.perf_counter() - start) / args.steps_per_block

    def plain_block() -> float:
        batches = [plain_batches.next_step() for _ in range(args.steps_per_block)]
        start = time.perf_counter()
        for micro_batches in batches:
            plain_loop_step(plain, optimizer, micro_batches, cfg.optim.grad_clip)
        return (time.perf_counter() - start) / args.steps_per_block

    trainer_block(), plain_block()  # warm-up: allocator, thread pools, first-touch pages
    trainer_times, plain_times = [], []
    for _ in range(args.blocks):
        trainer_times.append(trainer_block())
        plain_times.append(plain_block())
    trainer_s, plain_s = statistics.median(trainer_times), statistics.median(plain_times)
    print(
        f"recipe {cfg.name}: {cfg.train.global_batch} x {cfg.train.seq_len} tokens per step, "
        f"torch {torch.__version__}, {args.threads} threads"
    )
    print(f"plain PyTorch loop: {plain_s * 1e3:8.2f} ms/step (median of {args.blocks} blocks)")
    print(f"trainer step:       {trainer_s * 1e3:8.2f} ms/step")
    print(f"trainer / plain throughput ratio: {plain_s / trainer_s:.3f}")


if __name__ == "__main__":
    main()
