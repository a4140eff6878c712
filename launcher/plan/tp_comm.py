"""Tensor-parallel communication per transformer layer and optimizer step, for the plan.

Each block reduces twice in forward (after the attention output and the down projection,
both row-wise) and twice in backward (the gradients of the replicated inputs of the
column-wise Q/K/V and gate/up projections). Each collective works on one activation of
tokens x dim. With sequence parallelism each all-reduce becomes a reduce-scatter and the
column-wise inputs are all-gathered instead: twice the collectives, each half the ring
traffic of an all-reduce, so the bytes sent are the same (Korthikanti et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.layout import Degrees
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.schema import RecipeConfig


@dataclass(frozen=True)
class TPComm:
    """One layer's TP collectives over one optimizer step, on one rank."""

    collectives: dict[str, int]
    """Collective kind -> how many per micro-batch."""
    message_bytes: float
    """Size of the full activation each collective works on, summed over the step's
    micro-batches (this rank's tokens x dim x dtype bytes)."""
    sent_bytes: float
    """Bytes each rank sends for them on a ring: 2(t-1)/t of the message per all-reduce,
    (t-1)/t per all-gather or reduce-scatter."""


def tp_communication(cfg: RecipeConfig, degrees: Degrees) -> TPComm | None:
    """Per-layer TP traffic per step; None without tensor parallelism.

    Recompute (full or selective) repeats the two forward collectives of each recomputed
    layer in backward; that repetition is not counted here.
    """
    t = degrees.tp
    if t == 1:
        return None
    tokens = cfg.train.global_batch // degrees.dp * cfg.train.seq_len
    message = tokens * cfg.model.dim * COMPUTE_BYTES[cfg.precision.dtype]
    if cfg.parallel.sp:
        collectives = {"all_gather": 4, "reduce_scatter": 4}
        ring_share = (t - 1) / t
    else:
        collectives = {"all_reduce": 4}
        ring_share = 2 * (t - 1) / t
    count = sum(collectives.values())
    return TPComm(collectives, message * count, message * count * ring_share)
