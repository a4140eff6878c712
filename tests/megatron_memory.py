"""Megatron-LM's theoretical memory, re-derived for the dense Llama-style models here.

Read from NVIDIA/Megatron-LM, megatron/training/theoretical_memory_usage.py at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (`compute_weight_and_optimizer_memory` and
`compute_activation_memory`; the latter assumes sequence parallelism and selective
recomputation, Korthikanti et al. 2022, Table 2). Only the dense terms are kept (no MoE,
MLA or multi-token prediction), with RMSNorm (one weight per norm) and SwiGLU (3/2 of the
MLP's two matrices).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.model_config import ModelConfig


@dataclass(frozen=True)
class MegatronLayout:
    """The arguments of Megatron's estimate that a layout sets."""

    tp: int
    pp: int
    dp: int
    vpp: int | None = None
    """Virtual stages per rank (None: the non-interleaved schedule)."""
    distributed_optimizer: bool = True


def most_loaded_params(m: ModelConfig, layout: MegatronLayout) -> float:
    """Parameters on the most loaded rank: 1/pp of the blocks and the embedding, the
    tensor-parallel ones over tp; the norms replicated (and the head too without PP)."""
    q = m.n_heads * m.head_dim
    attention = 2 * m.dim * m.dim * ((1 + m.kv_heads / m.n_heads) * q / m.dim)
    mlp = 2 * m.dim * m.ffn_dim * 3 / 2
    norms = 2 * m.dim
    embedding = m.dim * m.vocab_size
    sharded = (attention + mlp) * m.n_layers / layout.pp + embedding
    if not m.tie_embeddings and layout.pp == 1:
        sharded += embedding
    replicated = (norms * m.n_layers + m.dim) / layout.pp
    return sharded / layout.tp + replicated


def bytes_per_param(layout: MegatronLayout) -> float:
    """BF16 weights (2), FP32 main gradients (4) and FP32 main weights with Adam's two moments
    (12), the last 12 split over dp by the distributed optimizer."""
    return 6 + 12 / layout.dp if layout.distributed_optimizer else 18


def weight_and_optimizer(m: ModelConfig, layout: MegatronLayout) -> float:
    """Bytes of weights, gradients and optimizer states on the most loaded rank."""
    return most_loaded_params(m, layout) * bytes_per_param(layout)


def layer_activations(m: ModelConfig, s: int, b: int, tp: int) -> float:
    """Bytes one layer keeps per micro-batch: sbh(18 + 4 ffn/h) / tp."""
    return s * b * m.dim * (18 + 4 * m.ffn_dim / m.dim) / tp


def schedule_factor(layout: MegatronLayout, microbatches: int) -> float:
    """What the first stage's pp micro-batches in flight are scaled by: 1 + (pp-1)/(pp vpp)
    interleaved, min(1, m/pp) otherwise under PP."""
    if layout.vpp is not None:
        return 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return min(1, microbatches / layout.pp) if layout.pp > 1 else 1.0


def in_flight(layout: MegatronLayout, microbatches: int) -> float:
    """Micro-batches of the first stage Megatron counts as held, in units of the stage."""
    return layout.pp * schedule_factor(layout, microbatches)


def embedding_activations(
    m: ModelConfig, s: int, b: int, layout: MegatronLayout, microbatches: int
) -> float:
    """The embedding's input ids (8 B each) and its dropout mask (1 B per element), for pp
    micro-batches in flight scaled by the schedule, over tp."""
    held = (8 * s * b + s * b * m.dim) * layout.pp * schedule_factor(layout, microbatches)
    return held / layout.tp


def head_activations(m: ModelConfig, s: int, b: int, layout: MegatronLayout) -> float:
    """Without PP: the output layer's input and the cross-entropy's FP32 logits, over tp."""
    if layout.pp > 1:
        return 0.0
    return s * b * m.dim * 4 * (1 + m.vocab_size / m.dim) / layout.tp


def activations(m: ModelConfig, s: int, b: int, layout: MegatronLayout, microbatches: int) -> float:
    """Megatron's activation bytes of the first pipeline stage."""
    stage = layer_activations(m, s, b, layout.tp) * m.n_layers / layout.pp
    return (
        stage * in_flight(layout, microbatches)
        + embedding_activations(m, s, b, layout, microbatches)
        + head_activations(m, s, b, layout)
    )
