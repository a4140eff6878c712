"""The MoE layer's forward + backward with the grouped GEMM against the per-expert loop.

One `MoEFeedForward` (models/moe.py) per expert count, built twice with the same weights:
`moe_gemm=grouped` (one `torch._grouped_mm` per projection over all experts) and
`moe_gemm=loop` (one matmul per expert, the reference path). Each timed call is a forward
and a backward of the layer on the same tokens; the two paths alternate in rounds so that
machine noise hits both alike, and the medians are compared. The outputs and gradients of
the two are compared too (max absolute difference, FP32).

    python bench/moe_grouped_gemm.py [--experts 8 64] [--tokens 4096] [--dim 256]
        [--ffn 256] [--top-k 2] [--rounds 7] [--threads 1] [--device cpu] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretrain.core.model_config import ModelConfig
from pretrain.models.moe import MoEFeedForward

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer(experts: int, args: argparse.Namespace, gemm: str) -> MoEFeedForward:
    """One MoE layer with `experts` experts of the benchmark's shape (seeded weights)."""
    cfg = ModelConfig(
        dim=args.dim,
        n_heads=1,
        moe_experts=experts,
        moe_top_k=args.top_k,
        moe_ffn_dim=args.ffn,
        moe_gemm=gemm,
    )
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    for weight in (moe.router.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3):
        torch.nn.init.normal_(weight, std=0.02)
    return moe.to(args.device, DTYPES[args.dtype])


def forward_backward(moe: MoEFeedForward, x: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and the experts' weight gradients of one call."""
    moe.zero_grad(set_to_none=True)
    inputs = x.clone().requires_grad_()
    out = moe(inputs)
    out.backward(torch.ones_like(out))
    return [out, inputs.grad, moe.experts.w1.grad, moe.experts.w2.grad, moe.experts.w3.grad]


def timed(moe: MoEFeedForward, x: torch.Tensor, device: torch.device) -> float:
    start = time.perf_counter()
    forward_backward(moe, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(1, args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    x = x.to(device, DTYPES[args.dtype])
    print(f"torch {torch.__version__}, {args.device} {args.dtype}, {args.threads} thread(s), "
          f"{args.tokens} tokens, h={args.dim}, f={args.ffn}, top-{args.top_k}")  # fmt: skip
    print("| experts | loop ms | grouped ms | loop / grouped | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for experts in args.experts:
        grouped, loop = layer(experts, args, "grouped"), layer(experts, args, "loop")
        assert grouped.experts.uses_grouped_mm(x.reshape(-1, args.dim))
        diff = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(forward_backward(grouped, x), forward_backward(loop, x), strict=True)
        )
        times: dict[str, list[float]] = {"grouped": [], "loop": []}
        for i in range(args.rounds):
            order = [("grouped", grouped), ("loop", loop)][:: 1 if i % 2 else -1]
            for name, moe in order:
                times[name].append(timed(moe, x, device))
        g, lp = statistics.median(times["grouped"]), statistics.median(times["loop"])
        print(f"| {experts} | {lp * 1e3:.1f} | {g * 1e3:.1f} | {lp / g:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
