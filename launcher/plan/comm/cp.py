"""Context-parallel ring traffic per transformer layer and optimizer step, for the plan and
the cost model.

Per layer and micro-batch (parallel/ring_attention.py): each cp rank's keys and values (its s/cp
tokens x kv_heads/tp x (key + value head width), in the compute dtype; under MLA the
decompressed per-head ones, not the latent) travel cp-1 hops in forward;
in backward they travel cp-1 hops again and their FP32 gradients cp hops (the last brings
each rank its own). Recompute (full or selective) repeats the forward's hops. The cp ranks
of a ring are tp apart (mesh dims outer to inner: pp, dp_replicate, dp_shard, cp, tp), so
the ring stays inside a node when tp*cp ranks fit one; otherwise every hop crosses the
inter-node link (the cost model's `group_bandwidth`). Each hop overlaps the attention over
the chunks held.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.layout import Degrees
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.schema import RecipeConfig


@dataclass(frozen=True)
class CPComm:
    """One layer's ring exchanges over one optimizer step, on one rank."""

    hops: dict[str, int]
    """Hops per micro-batch: forward, backward (keys and values), gradients, recompute."""
    sent_bytes: float
    """Bytes this rank sends per layer per step."""
    ring_span: int
    """Ranks the ring spans in the global order (tp * cp): inside a node when it fits one."""
    crosses_nodes: bool


def cp_communication(cfg: RecipeConfig, degrees: Degrees) -> CPComm | None:
    """Per-layer ring traffic per step; None without context parallelism."""
    cp, m = degrees.cp, cfg.model
    if cp == 1:
        return None
    tokens = cfg.train.global_batch // degrees.dp * cfg.train.seq_len // cp
    kv_elements = tokens * m.kv_heads * (m.qk_head_dim + m.v_head_dim) / degrees.tp
    element = COMPUTE_BYTES[cfg.precision.dtype]
    hops = {"forward": cp - 1, "backward": cp - 1, "gradients": cp}
    if cfg.recompute.policy != "none":
        hops["recompute"] = cp - 1
    kv_hops = hops["forward"] + hops["backward"] + hops.get("recompute", 0)
    sent = kv_elements * (element * kv_hops + 4 * hops["gradients"])
    span = degrees.tp * cp
    gpn = cfg.cluster.gpus_per_node
    return CPComm(hops, sent, span, crosses_nodes=span > gpn or gpn % span != 0)
