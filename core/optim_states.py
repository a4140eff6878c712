"""Optimizer-state dtypes and their bytes: what the trainer stores and the planner counts."""

from __future__ import annotations

STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
"""`optim.state_dtype` choices."""
STATE_BLOCK = 32
"""Elements per FP32 scale of the 8- and 4-bit states, along a tensor's last dim."""
CODE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}


def state_bytes(dtype: str) -> float:
    """Bytes one state element occupies: its code plus its share of the block's FP32 scale."""
    scale = 4 / STATE_BLOCK if dtype in ("int8", "int4") else 0.0
    return CODE_BITS[dtype] / 8 + scale
