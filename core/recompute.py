"""Which blocks recompute their activations: one rule for the trainer (which wraps them),
HFU and the planner's memory and cost models."""

from __future__ import annotations

from collections.abc import Iterable

from pretrain.core.schema import RecomputeConfig


def is_recomputed(cfg: RecomputeConfig, layer: int) -> bool:
    """Whether the block of global index `layer` recomputes: every block under selective,
    every `every`-th one (layers every-1, 2*every-1, ...) under full."""
    if cfg.policy == "none":
        return False
    every = cfg.every if cfg.policy == "full" else 1
    return layer % every == every - 1


def recomputed_blocks(cfg: RecomputeConfig, layers: int | Iterable[int]) -> list[int]:
    """The recomputed ones among `layers` (global indices, or a count meaning 0..n-1)."""
    indices = range(layers) if isinstance(layers, int) else layers
    return [i for i in indices if is_recomputed(cfg, i)]
