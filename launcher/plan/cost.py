"""Estimated step time of a layout: one cost model, stated term by term, for the plan and
the layout search alike.

    step = m * max_r u_r + (sum_r u_r - max_r u_r) / v + dp exposed + muon
    u_r  = compute_r + tp_r + cp_r + ep_r + pp_p2p     (pipeline rank r, one micro-batch)

- compute_r: the FLOPs pipeline rank r runs per micro-batch (its own blocks, with the
  recomputation of those that recompute, from `models.flops`, the functions MFU uses; the
  last rank adds the LM head and the multi-token prediction modules, whose blocks' TP
  collectives tp_r counts too; the embedding costs no matmul) at COMPUTE_EFFICIENCY of the
  GPU's dense peak. Uneven stages (`parallel.pp_layers`) give each rank its own share. A
  MoE layer's router and experts run whole on every TP rank (parallel/expert.py): tp does
  not divide their FLOPs; etp divides the routed experts'.
- tp_r: tensor parallelism's collectives, not overlapped. Per block and micro-batch, forward
  and backward each move two all-reduces of the block's s*b*h activations in the compute
  dtype (with SP, a reduce-scatter and an all-gather each: the same bytes); a fully
  recomputed block repeats the forward's. A ring moves 2(t-1)/t of the message per rank,
  in 2(t-1) steps of one latency each. Expert tensor parallelism adds its all-reduces over
  the etp ranks of the tp group (`pretrain.launcher.plan.ep_comm.etp_all_reduces`).
- ep_r: expert parallelism's all-to-alls (`pretrain.launcher.plan.ep_comm`): dispatch and combine,
  forward and backward, again under full recompute, not overlapped, over the link the ep
  group spans, one latency each.
- cp_r: context parallelism's K/V ring (`pretrain.launcher.plan.cp_comm`: every layer's hops, over
the
  link the ring crosses), hidden up to CP_OVERLAP of the attention-score compute it
  overlaps; the rest is exposed. Under cp, every rank computes and sends 1/cp of each
  sequence's tokens, and gradients are reduced over dp x cp.
- pp_p2p: one activation forward and one gradient backward per micro-batch and chunk between
  stages (1/t of it with SP), not overlapped; with tied embeddings the all-reduce of the
  embedding's gradient between the first and the last stage after the last backward (none
  under a V schedule, whose first rank holds both). Every send adds one latency.
- bubble: the pipeline runs at the pace of its slowest rank (m of its micro-batches), and the
  fill and drain cost every other rank's time once, divided by v under the interleaved
  schedules (v chunks per rank). With equal ranks this is the closed form
  `schedule_sim.bubble_fraction`, x/(1+x) with x=(p-1)/(v m); zero_bubble is counted at
  that value, an upper bound. The V schedules (zbv, dualpipev) and 2bw have no closed
  form: their simulated idle share (F = B = W; 2bw's over a segment between two drains,
  `schedule_sim.bubble_fraction`) of the slowest rank's time.
- dp: the data-parallel traffic of the trainer's bookkeeping (`pretrain.launcher.plan.memory`
states it),
  FP32 gradients and parameter all-gathers in the compute dtype:
  ZeRO-0/1 all-reduce the gradients over dp (ZeRO-1 then all-gathers the updated FP32
  parameters over dp_shard after the step: exposed); ZeRO-2/3 reduce-scatter them over
  dp_shard and all-reduce the shard over dp_replicate, and all-gather the parameters once
  per step (ZeRO-2) or twice per micro-batch (ZeRO-3). Routed experts' gradients and
  gathers go over the ranks holding the same experts (dp / ep of them, x cp), the dense
  parameters' over dp x cp (`_group_traffic`). Gradient reduction overlaps the last
  micro-batch's backward, parameter gathers the compute of every micro-batch, each up to
  DP_OVERLAP of that window; the rest is exposed.

- muon: with optim.name=muon, the busiest rank's Newton-Schulz FLOPs (after the split over
  data-parallel ranks, `pretrain.launcher.plan.muon_work`) at the compute rate, and the bytes
  it receives to orthogonalize over the data-parallel link; exposed, as the optimizer step
  follows the last backward.

A group's collectives run at the GPU's intra-node bandwidth when the whole group sits in one
node (mesh dims outer to inner: pp, dp_replicate, dp_shard, tp), else at its inter-node
bandwidth (`pretrain.core.hardware.LINKS`, or the recipe's `hardware.*` figures), both at
LINK_EFFICIENCY; each step of a collective and each send costs that link's latency (the
data-parallel traffic's latencies are left in its overlap). Embedding and loss terms are
left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core import hardware
from pretrain.core.hardware import Links
from pretrain.core.layout import Degrees, world_size
from pretrain.core.pipedream import segment_steps
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.recompute import is_recomputed, recomputed_blocks
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import head_rank, placement
from pretrain.launcher.plan.cp_comm import cp_communication
from pretrain.launcher.plan.ep_comm import (
    all_to_alls,
    ep_communication,
    etp_all_reduces,
    etp_communication,
)
from pretrain.launcher.plan.memory import rank_layers, stage_experts, stage_params
from pretrain.launcher.plan.muon_work import muon_work
from pretrain.launcher.plan.schedule_sim import SIMULATED, bubble_fraction
from pretrain.models.flops import block_flops_per_token, count_params, flops_per_token

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
    ep: float = 0.0
    """Expert parallelism's all-to-alls (dispatch and combine), not overlapped."""
    muon: float = 0.0
    """Muon's Newton-Schulz and the traffic of its matrices, after the last backward."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed_communication + self.bubble + self.muon

    @property
    def exposed_communication(self) -> float:
        """Seconds of traffic that no computation hides: tp, cp, ep, pipeline sends, dp's
        exposed share."""
        return self.tp + self.cp + self.ep + self.pp_p2p + self.dp_exposed

    @property
    def communication(self) -> float:
        """Seconds of traffic of every kind, hidden or not (the ranking's tie-break)."""
        return self.tp + self.cp + self.ep + self.pp_p2p + self.dp_total

    def terms(self) -> dict[str, float]:
        """The terms that add up to `total`, by name."""
        return {
            "compute": self.compute,
            "tp": self.tp,
            "cp": self.cp,
            "ep all-to-all": self.ep,
            "pp p2p": self.pp_p2p,
            "bubble": self.bubble,
            "dp exposed": self.dp_exposed,
            "muon": self.muon,
        }


def inside_node(gpus_per_node: int, stride: int, size: int) -> bool:
    """Whether a group of `size` ranks `stride` apart sits in one node."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0


def group_bandwidth(links: Links, gpus_per_node: int, stride: int, size: int) -> float:
    """Bytes/s per rank of a group of `size` ranks `stride` apart: NVLink inside one node."""
    inside = inside_node(gpus_per_node, stride, size)
    gbs = links.intra_node_gbs if inside else links.inter_node_gbs
    return gbs * 1e9 * LINK_EFFICIENCY


def group_latency(links: Links, gpus_per_node: int, stride: int, size: int) -> float:
    """Seconds one step of a collective (or one send) of that group costs, whatever its size."""
    inside = inside_node(gpus_per_node, stride, size)
    return 1e-6 * (links.intra_node_latency_us if inside else links.inter_node_latency_us)


def recipe_links(cfg: RecipeConfig, gpu_type: str) -> Links | None:
    """The GPU table's links of `gpu_type` with the recipe's `hardware.*` figures over them."""
    table = hardware.links(gpu_type)
    if table is None:
        return None
    h = cfg.hardware
    return hardware.with_overrides(
        table,
        {
            "intra_node_gbs": h.intra_node_gbs,
            "inter_node_gbs": h.inter_node_gbs,
            "intra_node_latency_us": h.intra_node_latency_us,
            "inter_node_latency_us": h.inter_node_latency_us,
        },
    )


def _layer_flops(cfg: RecipeConfig) -> list[tuple[int, int, int, int]]:
    """(hardware, forward, replicated, routed) FLOPs per token of each block, recomputation
    included; `replicated` is the part of `hardware` that tp does not split (a MoE layer's
    router and experts: parallel/expert.py hands every TP rank the whole layer), `routed`
    the part of it that etp splits (the routed experts)."""
    m, seq, policy = cfg.model, cfg.train.seq_len, cfg.recompute.policy
    # Every block of a dense model is the same, recomputed or not.
    dense = block_flops_per_token(m, seq, 0)
    plain = (dense.with_recompute(policy, 0.0), dense.forward, 0, 0)
    again = (dense.with_recompute(policy, 1.0), dense.forward, 0, 0)
    routed = m.moe_top_k * 3 * 2 * m.dim * m.expert_ffn_dim
    flops = []
    for layer in range(m.n_layers):
        recomputed = is_recomputed(cfg.recompute, layer)
        if m.moe_experts:
            block = block_flops_per_token(m, seq, layer)
            moe = m.is_moe_layer(layer)
            moe_passes = 3 + (1 if recomputed and policy == "full" else 0)
            hardware = block.with_recompute(policy, float(recomputed))
            replicated = moe_passes * block.mlp if moe else 0
            flops.append((hardware, block.forward, replicated, moe_passes * routed * moe))
        else:
            flops.append(again if recomputed else plain)
    return flops


def _rank_flops(
    cfg: RecipeConfig, layers: list[tuple[int, int, int, int]], pp_rank: int
) -> tuple[int, int, int, int]:
    held = rank_layers(cfg, pp_rank)
    hardware, forward = sum(layers[i][0] for i in held), sum(layers[i][1] for i in held)
    replicated, routed = sum(layers[i][2] for i in held), sum(layers[i][3] for i in held)
    p = cfg.parallel
    if pp_rank == head_rank(p.pp, p.vpp, placement(p.pp_schedule) if p.pp > 1 else "loop"):
        flops = flops_per_token(cfg.model, cfg.train.seq_len)
        head = flops.lm_head + flops.mtp  # the MTP modules run on the last stage, never again
        hardware, forward = hardware + 3 * head, forward + head
    return hardware, forward, replicated, routed


def step_cost(
    cfg: RecipeConfig, degrees: Degrees, microbatches: int, peak_tflops: float, links: Links
) -> StepCost:
    """Estimated seconds per optimizer step of `cfg`'s layout (see the module's model)."""
    p, t, pp = cfg.parallel, degrees.tp, degrees.pp
    gpn = cfg.cluster.gpus_per_node
    seq, b, c = cfg.train.seq_len, cfg.train.micro_batch, COMPUTE_BYTES[cfg.precision.dtype]
    tokens = cfg.train.global_batch * seq
    rate = peak_tflops * 1e12 * COMPUTE_EFFICIENCY
    # Under cp every rank computes (and sends) 1/cp of each sequence's tokens.
    mb_tokens = tokens / (degrees.dp * degrees.cp) / microbatches
    activation = seq // degrees.cp * b * cfg.model.dim * c

    layer_flops = _layer_flops(cfg)
    work = [_rank_flops(cfg, layer_flops, r) for r in range(pp)]
    etp = degrees.etp
    compute = [
        mb_tokens * ((hardware - replicated) / t + replicated - routed * (1 - 1 / etp)) / rate
        for hardware, _, replicated, routed in work
    ]
    tp_time = [0.0] * pp
    if t > 1:
        bandwidth = group_bandwidth(links, gpn, 1, t)
        # A ring all-reduce takes 2(t-1) steps; SP's reduce-scatter and all-gather t-1 each.
        steps = 2 * (t - 1) * group_latency(links, gpn, 1, t)
        full = cfg.recompute.policy == "full"
        for r in range(pp):
            layers = rank_layers(cfg, r)
            # Forward and backward of every block, and the forward again where recomputed.
            passes = 2 * len(layers) + (
                len(recomputed_blocks(cfg.recompute, layers)) if full else 0
            )
            if r == head_rank(pp, p.vpp, placement(p.pp_schedule) if pp > 1 else "loop"):
                passes += 2 * cfg.model.mtp_layers  # the MTP modules' blocks
            tp_time[r] = passes * 2 * (2 * (t - 1) / t * activation / bandwidth + steps)
    etp_time = _etp_all_reduces(cfg, degrees, links)
    tp_time = [tp_time[r] + etp_time[r] for r in range(pp)]
    a2a = _all_to_all(cfg, degrees, links)
    chunks = p.vpp if SCHEDULES[p.pp_schedule].interleaved else 1
    p2p = tied = 0.0
    if pp > 1:
        pp_bandwidth = group_bandwidth(links, gpn, t * degrees.dp, pp)
        send = activation / (t if p.sp else 1) / pp_bandwidth
        p2p = 2 * chunks * (send + group_latency(links, gpn, t * degrees.dp, pp))
        if cfg.model.tie_embeddings and placement(p.pp_schedule) != "v":
            # Two ranks all-reduce the embedding's FP32 gradient (its dp shard under FSDP).
            grad = 4 * count_params(cfg.model).embedding / t
            tied = grad / (degrees.dp_shard if p.zero >= 2 else 1) / pp_bandwidth

    ring = _ring(cfg, degrees, links, microbatches, rate)
    per_rank = [compute[r] + tp_time[r] + ring[r] + a2a[r] + p2p for r in range(pp)]
    slowest = max(range(pp), key=lambda r: per_rank[r])
    fill_drain = (sum(per_rank) - per_rank[slowest]) / chunks
    if p.pp_schedule in SIMULATED and pp > 1:
        fraction = bubble_fraction(p.pp_schedule, pp, microbatches, p.vpp, segment_steps(cfg))
        fill_drain = microbatches * per_rank[slowest] * fraction / (1 - fraction)
    hardware, forward, _, _ = work[slowest]
    # The gradient reduction overlaps the last micro-batch's backward (recomputation included).
    last_backward = compute[slowest] * (1 - forward / hardware) if hardware else 0.0
    dp_total, dp_exposed = _data_parallel(
        cfg, degrees, microbatches, links, microbatches * compute[slowest], last_backward
    )
    return StepCost(
        compute=microbatches * compute[slowest],
        tp=microbatches * tp_time[slowest],
        pp_p2p=microbatches * p2p + tied,
        bubble=fill_drain,
        dp_total=dp_total,
        dp_exposed=dp_exposed,
        cp=microbatches * ring[slowest],
        ep=microbatches * a2a[slowest],
        muon=_muon(cfg, degrees, links, rate),
    )


def _muon(cfg: RecipeConfig, degrees: Degrees, links: Links, rate: float) -> float:
    """Seconds of Muon's orthogonalization on the busiest rank (`pretrain.launcher.plan.
    muon_work`): its Newton-Schulz FLOPs at the compute rate, its bytes over the
    data-parallel link (dp ranks are tp x cp apart), exposed."""
    work = muon_work(cfg, degrees)
    if work is None:
        return 0.0
    gpn = cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, degrees.tp * degrees.cp, degrees.dp)
    return work.flops / rate + work.bytes / bandwidth


def _all_to_all(cfg: RecipeConfig, degrees: Degrees, links: Links) -> list[float]:
    """Per pipeline rank and micro-batch, the seconds of its MoE layers' expert all-to-alls
    (`pretrain.launcher.plan.ep_comm`; not overlapped: the experts wait for their rows)."""
    comm = ep_communication(cfg, degrees)
    if comm is None:
        return [0.0] * degrees.pp
    gpn = cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, comm.stride, degrees.ep)
    # The sends of one all-to-all are posted together: one step of latency.
    one = comm.message_bytes / bandwidth + group_latency(links, gpn, comm.stride, degrees.ep)
    return [all_to_alls(cfg, rank_layers(cfg, r)) * one for r in range(degrees.pp)]


def _etp_all_reduces(cfg: RecipeConfig, degrees: Degrees, links: Links) -> list[float]:
    """Per pipeline rank and micro-batch, the seconds of its MoE layers' all-reduces over the
    etp ranks (consecutive ranks of a tp group), as a ring: 2(e-1)/e of each message in
    2(e-1) steps; zeros without etp."""
    comm = etp_communication(cfg, degrees)
    if comm is None:
        return [0.0] * degrees.pp
    e, gpn = degrees.etp, cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, 1, e)
    steps = 2 * (e - 1) * group_latency(links, gpn, 1, e)
    times = []
    for r in range(degrees.pp):
        outputs, gates = etp_all_reduces(cfg, rank_layers(cfg, r))
        sent = outputs * comm.output_bytes + gates * comm.gate_bytes
        times.append(2 * (e - 1) / e * sent / bandwidth + (outputs + gates) * steps)
    return times


def _ring(
    cfg: RecipeConfig, degrees: Degrees, links: Links, microbatches: int, rate: float
) -> list[float]:
    """Per pipeline rank and micro-batch, the seconds of its layers' K/V ring traffic the
    attention scores do not hide (zeros without cp)."""
    comm = cp_communication(cfg, degrees)
    if comm is None:
        return [0.0] * degrees.pp
    m = cfg.model
    gpn = cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, degrees.tp, degrees.cp)
    # Every hop waits for its predecessor: its latency is not hidden.
    hop_latency = sum(comm.hops.values()) * group_latency(links, gpn, degrees.tp, degrees.cp)
    tokens = cfg.train.global_batch * cfg.train.seq_len / (degrees.dp * degrees.cp)
    scores = 3 * flops_per_token(m, cfg.train.seq_len).attention_scores / m.n_layers
    ring = []
    for r in range(degrees.pp):
        layers = len(rank_layers(cfg, r))
        hidden = CP_OVERLAP * layers * scores * tokens / degrees.tp / rate
        exposed = max(0.0, layers * comm.sent_bytes / bandwidth - hidden) / microbatches
        ring.append(exposed + layers * hop_latency)
    return ring


def _data_parallel(
    cfg: RecipeConfig,
    degrees: Degrees,
    microbatches: int,
    links: Links,
    compute: float,
    last_backward: float,
) -> tuple[float, float]:
    """(all data-parallel seconds, the part not hidden) for the largest pipeline rank: its
    dense parameters over dp x cp, its routed experts over their own group."""
    counts = count_params(cfg.model)
    # The largest pipeline rank's parameters (embedding, head and uneven splits counted).
    dense, experts = max(
        (sum(stage_params(cfg, r, counts)[:2]), stage_experts(cfg, r, counts))
        for r in range(degrees.pp)
    )
    t, cp = degrees.tp, degrees.cp
    # cp joins the gradient reduction: dp x cp ranks, tp apart (FSDP shards over dp_shard x cp).
    shard, replicate = degrees.dp_shard * cp, degrees.dp_replicate
    own = (dense - experts) / t
    dense_traffic = _group_traffic(cfg, microbatches, links, own, t, shard, replicate)
    # Routed experts: ep splits them and etp their hidden width, tp does not (every TP rank
    # holds a MoE layer whole); their gradients reduce over the expert-data-parallel ranks
    # holding the same ones: dp / ep of them (x cp), tp x cp x ep apart (parallel/expert.py).
    edp = degrees.dp // degrees.ep * cp
    local_experts = experts / (degrees.ep * degrees.etp)
    expert_traffic = _group_traffic(cfg, microbatches, links, local_experts, t * degrees.ep, edp, 1)
    reduce, gather, after_step = (a + b for a, b in zip(dense_traffic, expert_traffic, strict=True))
    exposed = (
        max(0.0, reduce - DP_OVERLAP * last_backward)
        + max(0.0, gather - DP_OVERLAP * compute)
        + after_step
    )
    return reduce + gather + after_step, exposed


def _group_traffic(
    cfg: RecipeConfig,
    microbatches: int,
    links: Links,
    params: float,
    stride: int,
    shard: int,
    replicate: int,
) -> tuple[float, float, float]:
    """(gradient reduction, parameter gathers, ZeRO-1's after-step gather) seconds of
    `params` parameters per rank whose data-parallel group is `shard` x `replicate` ranks,
    `stride` apart (shard inner).

    ZeRO-0/1 all-reduce the FP32 gradients once per step; ZeRO-1 then all-gathers the
    updated FP32 parameters over the shard ranks. ZeRO-2/3 reduce-scatter them over the
    shard ranks and all-reduce the shard over the replicas. ZeRO-2 all-gathers the
    parameters once per step: its blocks stay unsharded through forward and backward, and
    between accumulation micro-batches (parallel/data_parallel.py keeps them so, as
    Megatron's distributed optimizer gathers once per step: Megatron-LM
    docs/source/api-guide/dist_optimizer.md). ZeRO-3 gathers each block in every
    micro-batch's forward and again in its backward (FSDP2 with reshard_after_forward).
    """
    gpn, c = cfg.cluster.gpus_per_node, COMPUTE_BYTES[cfg.precision.dtype]
    group = shard * replicate
    if group == 1 or params == 0:
        return 0.0, 0.0, 0.0
    grads = 4 * params
    zero = cfg.parallel.zero
    shard_bw = group_bandwidth(links, gpn, stride, shard)
    reduce = gather = after_step = 0.0
    if zero <= 1:
        reduce = 2 * grads * (group - 1) / group / group_bandwidth(links, gpn, stride, group)
        if zero == 1 and shard > 1:
            after_step = 4 * params * (shard - 1) / shard / shard_bw
        return reduce, gather, after_step
    reduce = grads * (shard - 1) / shard / shard_bw
    if replicate > 1:
        replicate_bw = group_bandwidth(links, gpn, stride * shard, replicate)
        reduce += 2 * grads / shard * (replicate - 1) / replicate / replicate_bw
    gathers = 2 * microbatches if zero == 3 else 1
    gather = gathers * c * params * (shard - 1) / shard / shard_bw
    return reduce, gather, after_step


def predicted_mfu(cfg: RecipeConfig, step_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation of a step of `step_s` seconds: model FLOPs per second over
    the dense peak of every rank (recomputation is not counted, as in the trainer's MFU)."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    train = flops_per_token(cfg.model, cfg.train.seq_len).train
    return tokens * train / (world_size(cfg) * step_s * peak_tflops * 1e12)


def assumptions(gpu_type: str, links: Links, peak_tflops: float, dtype: str) -> list[str]:
    """The cost model's stated figures for a GPU, one line each."""
    return [
        f"compute at {COMPUTE_EFFICIENCY:.0%} of {gpu_type}'s dense {dtype} peak "
        f"({peak_tflops:g} TFLOP/s), recomputation included",
        f"links at {LINK_EFFICIENCY:.0%} of nominal: {links.intra_node_gbs:g} GB/s inside a node, "
        f"{links.inter_node_gbs:g} GB/s per GPU between nodes; latency "
        f"{links.intra_node_latency_us:g} us / {links.inter_node_latency_us:g} us per step",
        "TP/SP collectives and pipeline sends exposed; DP traffic hidden up to "
        f"{DP_OVERLAP:.0%} of its window (gradients: the last micro-batch's backward; "
        "parameter gathers: all compute); ZeRO-2 gathers once per step, ZeRO-3 per "
        "micro-batch; ZeRO-1's parameter all-gather after the step exposed; routed experts "
        "over their own data-parallel group",
        "expert all-to-alls (dispatch, combine; forward, backward) exposed",
        "the pipeline at the pace of its slowest rank (its own blocks, the LM head on the "
        "last), the others' fill and drain once, divided by vpp when interleaved; the V "
        "schedules' and 2bw's simulated bubble",
        f"context parallelism: each layer's K/V ring over the link its tp*cp ranks span, "
        f"hidden up to {CP_OVERLAP:.0%} of the attention-score compute",
    ]
