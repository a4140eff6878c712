"""Optimizer facts the trainer and the planner share: the state dtypes and their bytes (what
the trainer stores and the planner counts), and Muon's Newton-Schulz FLOPs and how distributed
Muon splits them over ranks (`assign_owners`: the trainer runs that split and the planner
counts it)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
"""`optim.state_dtype` choices."""
STATE_BLOCK = 32
"""Elements per FP32 scale of the 8- and 4-bit states, along a tensor's last dim."""
CODE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}


def state_bytes(dtype: str) -> float:
    """Bytes one state element occupies: its code plus its share of the block's FP32 scale."""
    scale = 4 / STATE_BLOCK if dtype in ("int8", "int4") else 0.0
    return CODE_BITS[dtype] / 8 + scale


MOMENTS = {"adamw": 2, "lion": 1, "sgd": 1, "muon": 1}
"""State tensors per parameter (SGD without momentum keeps none; Muon's one is on the blocks'
weight matrices, the rest keep AdamW's two: `state_tensors`)."""


class _Optimizer(Protocol):
    """What `state_tensors` reads of an OptimConfig (the schema imports this module)."""

    name: str
    momentum: float


def state_tensors(optim: _Optimizer) -> tuple[int, int]:
    """Optimizer state tensors per parameter: (the blocks' weight matrices, all others)."""
    if optim.name == "muon":
        return 1, 2  # Muon's momentum; AdamW's two moments on embeddings, head and norms
    n = 0 if optim.name == "sgd" and not optim.momentum else MOMENTS[optim.name]
    return n, n


NS_STEPS = 5
"""Iterations of the quintic Newton-Schulz orthogonalization (Keller Jordan's Muon)."""


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of orthogonalizing one rows x cols matrix: per iteration, with X the
    a x b matrix of a = min(rows, cols), the Gram matrix X X^T (2 a^2 b), its square
    (2 a^3) and the product with X (2 a^2 b)."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a**3)


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank (0 .. ranks - 1) that orthogonalizes each item of `costs`: the longest
    items first, each to the least loaded rank so far (the lowest such rank on a tie).

    A pure function of its arguments, so every rank computes the same assignment; the
    busiest rank carries at most the mean load plus the largest item.
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: the work needs at least one rank")
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(ranks)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for item in order:
        load, rank = heapq.heappop(loads)
        owners[item] = rank
        heapq.heappush(loads, (load + costs[item], rank))
    return owners


def busiest_load(costs: Sequence[float], ranks: int) -> float:
    """The largest total cost `assign_owners` gives one rank."""
    loads = [0.0] * ranks
    for cost, owner in zip(costs, assign_owners(costs, ranks), strict=True):
        loads[owner] += cost
    return max(loads, default=0.0)
