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

from pretrain.core.layout import Degrees, uses_fsdp
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.recompute import is_recomputed
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.memory import residual_bytes

REDUCE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per gradient element of `precision.reduce_dtype`."""


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


def _fsdp(cfg: RecipeConfig, degrees: Degrees) -> bool:
    """Whether FSDP2 holds the parameters (`core.layout.uses_fsdp`)."""
    return uses_fsdp(cfg.parallel, degrees)


Call = tuple[str, float]
"""One collective a rank issues per micro-batch: its kind and the bytes it is handed."""


def block_collectives(cfg: RecipeConfig, degrees: Degrees, layer: int, tokens: float) -> list[Call]:
    """The TP collectives one rank issues in block `layer` per micro-batch of `tokens`
    tokens on the rank (forward, backward and recomputation); none without tensor
    parallelism. `block_calls` says which."""
    return block_calls(
        cfg, degrees, cfg.model.is_moe_layer(layer), is_recomputed(cfg.recompute, layer), tokens
    )


def block_calls(
    cfg: RecipeConfig, degrees: Degrees, moe: bool, recomputed: bool, tokens: float
) -> list[Call]:
    """The TP collectives of a block (a MoE one where `moe`, recomputed or not) per
    micro-batch of `tokens` tokens on the rank.

    Under SP (the sequence split over tp between the projections): each column-parallel
    input is all-gathered (its 1/tp share handed in) and its gradient reduce-scattered
    (the whole sequence handed in); each row-parallel output is reduce-scattered and its
    gradient all-gathered. Without SP each row-parallel output is all-reduced in forward
    and each column-parallel input's gradient in backward. Recomputation runs the forward's
    gathers again (the column inputs' saved tensors); selective recompute keeps the
    row-parallel outputs' reductions (parallel/recompute.py), and full recompute stops
    before the MLP's (its last saved tensors are that projection's inputs), so it repeats
    one. A MoE MLP runs whole on every TP rank: it gathers its input, and its output's
    gradient, and nothing else. MLA's latent projections take replicated local tensors:
    their up-projections' input gradients (and the shared rotary key's) are all-reduced.
    Key/value heads fewer than tp (parallel/tensor.py `_OneKVHead`): every rank holds the
    whole K and V weights and their gradients are all-reduced, once per micro-batch.

    Norm outputs and the residual stream are in `residual_bytes` (FP32 under autocast),
    matmul outputs and their gradients in the compute dtype.
    """
    t = degrees.tp
    if t == 1:
        return []
    m, sp = cfg.model, cfg.parallel.sp
    c, r = COMPUTE_BYTES[cfg.precision.dtype], residual_bytes(cfg, _fsdp(cfg, degrees))
    h = m.dim * tokens
    full = int(recomputed and cfg.recompute.policy == "full")
    # The two halves of the block: attention, then the MLP (dense or MoE).
    dense_mlp = int(not moe)
    row_outputs = 1 + dense_mlp  # wo, w2
    # Gradients of the halves' inputs that come back as partial sums (not MLA's, whose
    # projections reduce their own, nor a MoE MLP's, computed whole on every rank).
    input_grads = int(not m.is_mla) + dense_mlp
    if sp:
        inputs = 2 * (1 + int(recomputed))  # the attention's and the MLP's, again if recomputed
        calls = [("all_gather", r * h / t)] * inputs
        calls += [("reduce_scatter", c * h)] * (row_outputs + full)  # full: wo's again
        calls += [("all_gather", c * h / t)] * (row_outputs + 1 - dense_mlp)  # gradients
        calls += [("reduce_scatter", r * h)] * input_grads
    else:
        calls = [("all_reduce", c * h)] * (row_outputs + full)
        calls += [("all_reduce", r * h)] * input_grads
    if m.is_mla:
        widths = (m.mla_q_rank or m.dim, m.kv_rank, m.rope_dim)
        calls += [("all_reduce", c * width * tokens) for width in widths]
    elif m.kv_heads < t:
        # The whole K and V weights' gradients (and biases'), in the parameters' dtype.
        kv = m.kv_heads * m.head_dim * (m.dim + (1 if m.attn_bias else 0))
        calls += [("all_reduce", float(r * kv))] * 2
    return calls


def root_collectives(
    cfg: RecipeConfig, degrees: Degrees, first: bool, last: bool, tokens: float
) -> list[Call]:
    """The TP collectives one rank issues per micro-batch of `tokens` tokens outside the
    blocks: the vocabulary-split embedding's output reduced (and under SP its gradient
    gathered) on the first stage; on the last, the LM head's input gathered under SP and
    its gradient reduced, and the vocab-parallel loss's three all-reduces of a float per
    token; each multi-token prediction depth (on the last) adds an embedding of the tokens
    ahead, a block, and its share of the head and the loss (its rows are appended to the
    head's input)."""
    t = degrees.tp
    if t == 1:
        return []
    sp, h, depths = cfg.parallel.sp, cfg.model.dim * tokens, cfg.model.mtp_layers
    r = residual_bytes(cfg, _fsdp(cfg, degrees))
    heads = (1 + depths) if last else 0  # the LM head's rows, in micro-batches
    ends = int(first) + heads + (depths if last else 0)  # embeddings and heads
    calls: list[Call] = [("reduce_scatter" if sp else "all_reduce", float(r * h))] * ends
    if sp:
        calls += [("all_gather", r * h / t)] * ends
    calls += [("all_reduce", 4.0 * tokens)] * (3 * heads)
    if last:
        # Each depth's block is dense and not recomputed (recompute wraps the model's own).
        calls += depths * block_calls(cfg, degrees, False, False, tokens)
    return calls


def rank_collectives(
    cfg: RecipeConfig,
    degrees: Degrees,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    tokens: float | None = None,
) -> list[Call]:
    """Every TP collective a rank issues per micro-batch of `tokens` tokens on the rank
    (default `train.micro_batch` sequences of its cp share) for its blocks `layers`, its
    embedding (`first`) and its head (`last`)."""
    if tokens is None:
        tokens = float(cfg.train.seq_len // degrees.cp * cfg.train.micro_batch)
    calls = root_collectives(cfg, degrees, first, last, tokens)
    for layer in layers:
        calls += block_collectives(cfg, degrees, layer, tokens)
    return calls


def sp_weight_reduction(
    cfg: RecipeConfig, degrees: Degrees, layers: tuple[int, ...], last: bool
) -> float:
    """Bytes a rank all-reduces over tp per gradient reduction (once per step; every
    micro-batch under PipeDream-2BW) under SP for its replicated weights over
    sequence-sharded inputs, whose gradients are partial sums over tp: each block's two
    norms, and on the last rank the final norm and each multi-token prediction depth's
    norms, projection of [embedding; hidden] and block norms. Each is one all-reduce of the
    gradient accumulated over the micro-batches (4 bytes an element where a dry run counted
    them, reduce_dtype fp32). 0 without SP."""
    m = cfg.model
    if degrees.tp == 1 or not cfg.parallel.sp:
        return 0.0
    weights = 2 * m.dim * len(layers)
    if last:
        weights += m.dim + m.mtp_layers * (2 * m.dim * m.dim + 5 * m.dim)
    grad = 4 if cfg.parallel.zero < 2 else REDUCE_BYTES[cfg.precision.reduce_dtype]
    return float(grad * weights)
