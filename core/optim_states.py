"""Optimizer-state dtypes and their bytes: what the trainer stores and the planner counts."""

from __future__ import annotations

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
