"""Estimated step time of a layout: a simple cost model, stated term by term.

    step = (compute + tp + cp + pp_p2p) / (1 - bubble fraction) + dp exposed

- compute: the FLOPs each rank of the slowest pipeline stage runs (model FLOPs plus
  recomputation, from `models.flops`, the functions MFU uses; the last stage adds the LM
  head to its share of the blocks) at COMPUTE_EFFICIENCY of the GPU's dense peak.
- tp: tensor parallelism's collectives, not overlapped. Per block and micro-batch, forward
  and backward each move two all-reduces of the block's s*b*h activations in the compute
  dtype (with SP, a reduce-scatter and an all-gather each: the same bytes); full recompute
  repeats the forward's. A ring moves 2(t-1)/t of the message per rank for an all-reduce.
- cp: context parallelism's K/V ring (`launcher.cp_comm`: every layer's hops, over the
  link the ring crosses), hidden up to CP_OVERLAP of the attention-score compute it
  overlaps; the rest is exposed. Under cp, every rank computes and sends 1/cp of each
  sequence's tokens, and gradients are reduced over dp x cp.
- pp_p2p: one activation forward and one gradient backward per micro-batch between stages
  (times vpp when interleaved; 1/t of it with SP), not overlapped.
- bubble: `launcher.plan.bubble_fraction` of the pipelined time.
- dp: the data-parallel traffic of the trainer's bookkeeping (`launcher.memory` states it),
  FP32 gradients and parameter all-gathers in the compute dtype:
  ZeRO-0/1 all-reduce the gradients over dp (ZeRO-1 then all-gathers the updated FP32
  parameters over dp_shard after the step: exposed); ZeRO-2/3 reduce-scatter them over
  dp_shard and all-reduce the shard over dp_replicate, and all-gather the parameters once
  (ZeRO-2) or twice (ZeRO-3) per micro-batch. Gradient reduction overlaps the last
  micro-batch's backward, parameter gathers the compute of every micro-batch, each up to
  DP_OVERLAP of that window; the rest is exposed.

A group's collectives run at the GPU's intra-node bandwidth when the whole group sits in one
node (mesh dims outer to inner: pp, dp_replicate, dp_shard, tp), else at its inter-node
bandwidth (`pretrain_core.hardware.LINKS`), both at LINK_EFFICIENCY. Embedding, loss and latency
terms are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.cp_comm import cp_communication
from launcher.memory import COMPUTE_BYTES
from launcher.plan import bubble_fraction, recomputed_layers, segment_steps, stage_params
from models.flops import flops_per_token
from pretrain_core.hardware import Links
from pretrain_core.layout import Degrees
from pretrain_core.schema import RecipeConfig

COMPUTE_EFFICIENCY = 0.6
"""Share of the dense peak that a training step's kernels reach while computing."""
LINK_EFFICIENCY = 0.8
"""Share of a link's nominal bandwidth that NCCL collectives reach (bus bandwidth)."""
DP_OVERLAP = 0.8
"""Share of its overlap window that data-parallel traffic hides in."""
CP_OVERLAP = 0.8
"""Share of the attention-score compute a ring hop hides behind."""


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step, by term."""

    compute: float
    tp: float
    pp_p2p: float
    bubble: float
    dp_total: float
    """All data-parallel traffic, hidden or not."""
    dp_exposed: float
    """The part of `dp_total` the overlap windows do not hide."""
    cp: float = 0.0
    """Context parallelism's ring traffic the attention does not hide."""

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.pp_p2p + self.bubble + self.dp_exposed

    @property
    def communication(self) -> float:
        """Seconds of traffic of every kind, hidden or not (the ranking's tie-break)."""
        return self.tp + self.cp + self.pp_p2p + self.dp_total

    def terms(self) -> dict[str, float]:
        """The terms that add up to `total`, by name."""
        return {
            "compute": self.compute,
            "tp": self.tp,
            "cp": self.cp,
            "pp p2p": self.pp_p2p,
            "bubble": self.bubble,
            "dp exposed": self.dp_exposed,
        }


def group_bandwidth(links: Links, gpus_per_node: int, stride: int, size: int) -> float:
    """Bytes/s per rank of a group of `size` ranks `stride` apart: NVLink inside one node."""
    span = stride * size
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    gbs = links.intra_node_gbs if inside else links.inter_node_gbs
    return gbs * 1e9 * LINK_EFFICIENCY


def step_cost(
    cfg: RecipeConfig, degrees: Degrees, microbatches: int, peak_tflops: float, links: Links
) -> StepCost:
    """Estimated seconds per optimizer step of `cfg`'s layout (see the module's model)."""
    m, p = cfg.model, cfg.parallel
    t, pp, d, s_dp, r_dp, cp = (
        degrees.tp,
        degrees.pp,
        degrees.dp,
        degrees.dp_shard,
        degrees.dp_replicate,
        degrees.cp,
    )
    gpn = cfg.cluster.gpus_per_node
    seq, b, c = cfg.train.seq_len, cfg.train.micro_batch, COMPUTE_BYTES[cfg.precision.dtype]
    local_seq = seq // cp
    policy = cfg.recompute.policy

    fpt = flops_per_token(m, seq)
    share = recomputed_layers(m.n_layers, cfg.recompute.every) / m.n_layers
    hardware_flops = fpt.with_recompute(policy, share)
    # The pipeline runs at the pace of its slowest stage: the last, which adds the LM head
    # (not recomputed) to its share of the blocks; the embedding costs no matmul.
    head = 3 * fpt.lm_head
    stage_flops = (hardware_flops - head) / pp + head
    tokens = cfg.train.global_batch * seq
    rate = peak_tflops * 1e12 * COMPUTE_EFFICIENCY
    compute = tokens / (d * cp) * stage_flops / t / rate

    blocks = m.n_layers // pp
    activation = local_seq * b * m.dim * c
    tp_time = 0.0
    if t > 1:
        passes = 2 + (1 if policy == "full" else 0)
        per_rank = microbatches * blocks * passes * 2 * 2 * (t - 1) / t * activation
        tp_time = per_rank / group_bandwidth(links, gpn, 1, t)

    p2p = 0.0
    if pp > 1:
        vpp = p.vpp if p.pp_schedule == "interleaved_1f1b" else 1
        per_rank = microbatches * 2 * vpp * activation / (t if p.sp else 1)
        p2p = per_rank / group_bandwidth(links, gpn, t * d, pp)

    ring = 0.0
    comm = cp_communication(cfg, degrees)
    if comm is not None:
        scores = 3 * fpt.attention_scores * tokens / (d * cp) / t / pp / rate
        traffic = blocks * comm.sent_bytes / group_bandwidth(links, gpn, t, cp)
        ring = max(0.0, traffic - CP_OVERLAP * scores)

    fraction = bubble_fraction(p.pp_schedule, pp, microbatches, p.vpp, segment_steps(cfg))
    busy = compute + tp_time + ring + p2p
    bubble = busy / (1 - fraction) - busy

    local = max(stage_params(cfg)) / t
    grads = 4 * local
    # cp joins the gradient reduction: dp x cp ranks, tp apart (FSDP shards over dp_shard x cp).
    d, s_dp = d * cp, s_dp * cp
    dp_bw = group_bandwidth(links, gpn, t, d)
    shard_bw = group_bandwidth(links, gpn, t, s_dp)
    replicate_bw = group_bandwidth(links, gpn, t * s_dp, r_dp)
    reduce = gather = after_step = 0.0
    if d > 1 and p.zero <= 1:
        reduce = 2 * grads * (d - 1) / d / dp_bw
        if p.zero == 1 and s_dp > 1:
            after_step = 4 * local * (s_dp - 1) / s_dp / shard_bw
    elif d > 1:
        reduce = grads * (s_dp - 1) / s_dp / shard_bw
        if r_dp > 1:
            reduce += 2 * grads / s_dp * (r_dp - 1) / r_dp / replicate_bw
        gathers = microbatches * (2 if p.zero == 3 else 1)
        gather = gathers * c * local * (s_dp - 1) / s_dp / shard_bw
    backward_share = (hardware_flops - fpt.forward) / hardware_flops
    last_backward = compute / microbatches * backward_share
    exposed = (
        max(0.0, reduce - DP_OVERLAP * last_backward)
        + max(0.0, gather - DP_OVERLAP * compute)
        + after_step
    )
    return StepCost(compute, tp_time, p2p, bubble, reduce + gather + after_step, exposed, ring)


def assumptions(gpu_type: str, links: Links, peak_tflops: float, dtype: str) -> list[str]:
    """The cost model's stated figures for a GPU, one line each."""
    return [
        f"compute at {COMPUTE_EFFICIENCY:.0%} of {gpu_type}'s dense {dtype} peak "
        f"({peak_tflops:g} TFLOP/s), recomputation included",
        f"links at {LINK_EFFICIENCY:.0%} of nominal: {links.intra_node_gbs:g} GB/s inside a node, "
        f"{links.inter_node_gbs:g} GB/s per GPU between nodes",
        "TP/SP collectives and pipeline sends exposed; DP traffic hidden up to "
        f"{DP_OVERLAP:.0%} of its window (gradients: the last micro-batch's backward; "
        "parameter gathers: all compute); ZeRO-1's parameter all-gather after the step exposed",
        "1F1B (interleaved when vpp > 1) with the plan's bubble, at the pace of the last "
        "stage (its blocks and the LM head)",
        f"context parallelism: each layer's K/V ring over the link its tp*cp ranks span, "
        f"hidden up to {CP_OVERLAP:.0%} of the attention-score compute",
    ]
