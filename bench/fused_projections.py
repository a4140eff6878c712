"""Separate Q/K/V and gate/up projections against fused ones: one GEMM for q, k, v and one
for gate, up, as litgpt and Megatron lay them out.

In one process, on the same batches and starting weights: (separate) the model as it is
(wq, wk, wv and w1, w3 each an nn.Linear); (concat) one GEMM over [q; k; v] and one over
[gate; up], split by width, the cheapest fused forward but one that tensor parallelism
cannot shard exactly (a contiguous Shard(0) of [gate; up] gives rank 0 only gates);
(tp-exact) the layout a contiguous Shard(0) splits exactly under any tp: Q/K/V rows per KV
group (the group's q heads, then its k head, then its v head) and gate/up rows interleaved
one by one. Plain training steps (forward, cross-entropy, backward, clipping, AdamW
foreach) in rounds that rotate the order, medians; then the time per call of one
[tokens, dim] x [dim, N] GEMM for the widths involved, and optionally a profile of each.

    python -m bench.fused_projections [--threads 2] [--rounds 9] [--profile-steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from bench.step_overhead import plain_loop_step
from pretrain.core.model_config import ModelConfig
from pretrain.models import build
from pretrain.models.init import init_weights
from pretrain.models.layers import Attention, FeedForward, apply_rope, causal_attention

VARIANTS = ("separate", "concat", "tp-exact")


class FusedAttention(nn.Module):
    """The model's attention with q, k, v from one GEMM, in the `concat` or `tp-exact` rows."""

    def __init__(self, separate: Attention, layout: str) -> None:
        super().__init__()
        self.head_dim, self.layout = separate.head_dim, layout
        wq, wk, wv = (p.weight.detach() for p in (separate.wq, separate.wk, separate.wv))
        self.kv_heads = wk.shape[0] // self.head_dim
        self.q_per_group = wq.shape[0] // wk.shape[0]
        if layout == "concat":
            rows = torch.cat([wq, wk, wv])
        else:  # per KV group g: its q heads (q head h belongs to group h // q_per_group), k, v
            groups = [w.unflatten(0, (self.kv_heads, -1)) for w in (wq, wk, wv)]
            rows = torch.cat(groups, dim=1).flatten(0, 1)
        self.wqkv = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        self.wqkv.weight = nn.Parameter(rows.clone())
        self.wo = separate.wo

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        d, per = self.head_dim, self.q_per_group
        qkv = self.wqkv(x)
        if self.layout == "concat":
            q_width = self.kv_heads * per * d
            q, k, v = qkv.split([q_width, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            q, k, v = qkv.view(b, s, self.kv_heads, (per + 2) * d).split([per * d, d, d], -1)
        q, k, v = (t.reshape(b, s, -1, d) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FusedFeedForward(nn.Module):
    """SwiGLU with gate and up from one GEMM: [gate; up] (`concat`) or interleaved rows."""

    def __init__(self, separate: FeedForward, layout: str) -> None:
        super().__init__()
        self.layout = layout
        gate, up = separate.w1.weight.detach(), separate.w3.weight.detach()
        stacked = torch.stack([gate, up], dim=0 if layout == "concat" else 1)
        rows = stacked.flatten(0, 1)
        self.w13 = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        self.w13.weight = nn.Parameter(rows.clone())
        self.w2 = separate.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.w13(x)
        if self.layout == "concat":
            gate, up = both.chunk(2, dim=-1)
        else:
            gate, up = both.unflatten(-1, (-1, 2)).unbind(-1)
        return self.w2(F.silu(gate) * up)


def build_variant(cfg: ModelConfig, layout: str, seed: int) -> nn.Module:
    """The model initialized from `seed`, its projections fused in `layout` (or left)."""
    model = build(cfg)
    init_weights(model, seed)
    if layout != "separate":
        for block in model.layers.values():
            block.attention = FusedAttention(block.attention, layout)
            block.feed_forward = FusedFeedForward(block.feed_forward, layout)
    return model


def runner(model: nn.Module, batches: list[torch.Tensor], lr: float) -> Callable[[int], float]:
    """A function that runs n plain training steps of `model` and returns seconds per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    counter = iter(range(1 << 62))

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            tokens = batches[next(counter) % len(batches)]
            plain_loop_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], grad_clip=1.0)
        return (time.perf_counter() - start) / steps

    return run


def first_losses(models: dict[str, nn.Module], tokens: torch.Tensor) -> dict[str, float]:
    """The loss each variant gives on one batch before any step: equal when fused exactly."""
    with torch.no_grad():
        return {
            key: F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
            for key, m in models.items()
        }


def timed_rounds(
    runs: dict[str, Callable[[int], float]], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step of each runner in each round, the order rotating every round."""
    times: dict[str, list[float]] = {key: [] for key in runs}
    order = list(runs)
    for index in range(rounds):
        shift = index % len(order)
        for key in order[shift:] + order[:shift]:
            times[key].append(runs[key](steps))
    return times


def gemm_ms(tokens: int, dim: int, width: int, calls: int = 20) -> float:
    """Median milliseconds of one forward [tokens, dim] x [dim, width] GEMM."""
    x, w = torch.randn(tokens, dim), torch.randn(width, dim)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        F.linear(x, w)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:]) * 1e3


def op_times(run: Callable[[int], float], steps: int) -> dict[str, float]:
    """Self CPU ms per step of each op under torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(steps)
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def print_profiles(
    runs: dict[str, Callable[[int], float]], steps: int, rows: int, repeats: int = 2
) -> None:
    """The top ops (by their largest share in any variant) side by side: ms/step and share.

    Each variant is profiled `repeats` times, interleaved, and each op keeps its smallest
    figure: a descheduled thread on a shared machine inflates one sample, not all."""
    samples: dict[str, list[dict[str, float]]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            samples[key].append(op_times(run, steps))
    profiles = {}
    for key, runs_ops in samples.items():
        names = set().union(*runs_ops)
        ops = {name: min(o.get(name, 0.0) for o in runs_ops) for name in names}
        profiles[key] = (ops, sum(ops.values()))
    names = {name for ops, _ in profiles.values() for name in ops}

    def top_share(name: str) -> float:
        return max(ops.get(name, 0.0) for ops, _ in profiles.values())

    print(
        f"profile, self CPU ms/step (share), least of {repeats} x {steps} steps: "
        + " | ".join(runs)
    )
    for name in sorted(names, key=top_share, reverse=True)[:rows]:
        cells = [
            f"{ops.get(name, 0.0):7.1f} ({ops.get(name, 0.0) / total:5.1%})"
            for ops, total in profiles.values()
        ]
        print(f"  {name[:60]:60s} " + " | ".join(cells))
    print(f"  {'total':60s} " + " | ".join(f"{total:7.1f}" for _, total in profiles.values()))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("dim", 256),
        ("layers", 4),
        ("heads", 4),
        ("kv-heads", 4),
        ("ffn-dim", 768),
        ("vocab", 8192),
        ("seq-len", 256),
        ("batch", 8),
        ("threads", 2),
        ("rounds", 9),
        ("steps-per-round", 2),
        ("warmup-steps", 2),
        ("profile-steps", 0),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        name="llama", vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
        n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn_dim,
        max_seq_len=args.seq_len,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq_len + 1)
    batches = [torch.randint(0, args.vocab, shape, generator=generator) for _ in range(4)]
    models = {layout: build_variant(cfg, layout, seed=1234) for layout in VARIANTS}
    losses = first_losses(models, batches[0])
    runs = {key: runner(model, batches, lr=1e-3) for key, model in models.items()}
    for run in runs.values():
        run(args.warmup_steps)
    times = timed_rounds(runs, args.rounds, args.steps_per_round)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(
        f"d={args.dim}, {args.layers} layers, {args.heads} heads ({args.kv_heads} KV), "
        f"ffn {args.ffn_dim}, vocab {args.vocab}, {args.batch} x {args.seq_len} tokens, FP32, "
        f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds of "
        f"{args.steps_per_round} steps"
    )
    print("loss before the first step: " + ", ".join(f"{k} {v:.7f}" for k, v in losses.items()))
    for key, values in times.items():
        spread = (max(values) - min(values)) / median[key]
        print(
            f"{key:9s} {median[key] * 1e3:8.1f} ms/step (median; min {min(values) * 1e3:.1f}, "
            f"spread {spread:.0%}); throughput vs separate {median['separate'] / median[key]:.3f}"
        )
    tokens = args.batch * args.seq_len
    widths = sorted({args.dim, 3 * args.dim, args.ffn_dim, 2 * args.ffn_dim, args.vocab})
    rates = []
    for n in widths:
        ms = gemm_ms(tokens, args.dim, n)
        rates.append(f"N={n}: {ms:.2f} ms ({2 * tokens * args.dim * n / ms / 1e6:.0f} GFLOP/s)")
    print(f"GEMM [{tokens}, {args.dim}] x [{args.dim}, N]: " + ", ".join(rates))
    if args.profile_steps:
        print_profiles(runs, args.profile_steps, rows=16)


if __name__ == "__main__":
    main()
