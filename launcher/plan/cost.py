"""Estimated step time of a layout: one cost model, stated term by term, for the plan and
the layout search alike.

    step = m * max_r u_r + (sum_r u_r - max_r u_r) / v + dp exposed + muon
    u_r  = compute_r + tp_r + cp_r + ep_r + pp_p2p     (pipeline rank r, one micro-batch)

- compute_r: the seconds pipeline rank r computes per micro-batch, kernel by kernel
  (`pretrain.launcher.plan.compute`): each linear's three GEMMs at the shapes the rank runs
  after tp/cp/ep/etp splits, at the GPU's GEMM rates with tile, wave and output-drain losses;
  the attention kernel at its own rate; norms, residuals, rotary and the MoE dispatch copies
  at memory bandwidth; the recomputed forwards of the blocks that recompute. The last rank
  adds the LM head, the loss and the multi-token prediction modules (whose blocks' TP
  collectives tp_r counts too); the embedding costs no matmul. Under FP8 only the blocks'
  dense linears run at the FP8 rate, and the routed experts' where torchao has an FP8
  grouped GEMM for the scaling (`fp8_experts`). Uneven stages (`parallel.pp_layers`)
  give each rank its own share. A MoE layer's router and experts run whole on every TP rank
  (parallel/expert.py): tp does not divide their work; etp divides the routed experts'
  hidden width. The optimizer step streams the fullest rank's shard once per step. Where a
  calibration measured the host's work (per operator, per operator on DTensors, per FSDP2
  collective: `fsdp_calls`), it adds to compute on a CPU and paces it on a GPU, whose host
  runs ahead of its kernels (the larger of the two).
- tp_r: tensor parallelism's collectives, not overlapped (`pretrain.launcher.plan.comm.tp`).
  Per block and micro-batch, forward and backward each move two all-reduces of the block's
  s*b*h activations (with SP, two reduce-scatters and two all-gathers: the same bytes); a
  recomputed block gathers its inputs again (full recompute also reduces the attention's
  output again); the embedding and the head add theirs on their stages, and the last rank
  its multi-token prediction modules' blocks. Each collective's ring bytes
  (`pretrain.launcher.plan.comm.traffic.wire_bytes`: 2(t-1)/t of the message per rank for an
  all-reduce) go at the tp group's bandwidth, each ring step at one latency. Expert tensor
  parallelism adds its all-reduces over the etp ranks of the tp group
  (`pretrain.launcher.plan.comm.ep.etp_all_reduces`).
- ep_r: expert parallelism's all-to-alls (`pretrain.launcher.plan.comm.ep`): dispatch and combine,
  forward and backward, again where recomputed, not overlapped, over the link the ep
  group spans, one latency each.
- cp_r: context parallelism's K/V ring (`pretrain.launcher.plan.comm.cp`: every layer's
  hops, over the link the ring crosses), hidden behind the attention kernel it overlaps
  (`overlapped`: the part beyond it exposed, OVERLAP_SLOWDOWN of the part within). Under
  cp, every rank computes and sends 1/cp of each sequence's tokens, and gradients are
  reduced over dp x cp.
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
  states it), FP32 gradients and parameter all-gathers in the compute dtype:
  ZeRO-0/1 all-reduce the gradients over dp (ZeRO-1 then all-gathers the updated FP32
  parameters over dp_shard after the step: exposed); ZeRO-2/3 reduce-scatter them over
  dp_shard and all-reduce the shard over dp_replicate, and all-gather the parameters once
  per step (ZeRO-2) or twice per micro-batch (ZeRO-3). Routed experts' gradients and
  gathers go over the ranks holding the same experts (dp / ep of them, x cp), the dense
  parameters' over dp x cp (`_group_traffic`). Gradient reduction overlaps the last
  micro-batch's backward; ZeRO-3's gathers the compute of every micro-batch, a
  once-per-step gather the first micro-batch's forward (`overlapped`).

- muon: with optim.name=muon, the busiest rank's Newton-Schulz FLOPs (after the split over
  data-parallel ranks, `pretrain.launcher.plan.muon_work`) at a square GEMM's rate, and the bytes
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

import collections
from dataclasses import dataclass

from pretrain.core import hardware
from pretrain.core.hardware import KernelRates, Links
from pretrain.core.layout import Degrees, uses_fsdp, world_size
from pretrain.core.pipedream import segment_steps
from pretrain.core.precision import COMPUTE_BYTES, fp8_experts
from pretrain.core.recompute import is_recomputed
from pretrain.core.schedules import SCHEDULES, splits_backward
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import head_rank, placement, rank_stages
from pretrain.launcher.plan.comm.cp import cp_communication
from pretrain.launcher.plan.comm.ep import (
    all_to_alls,
    ep_communication,
    etp_all_reduces,
    etp_communication,
)
from pretrain.launcher.plan.comm.tp import rank_collectives
from pretrain.launcher.plan.comm.traffic import wire_bytes
from pretrain.launcher.plan.compute import (
    BlockSeconds,
    Kernels,
    block_seconds,
    block_work,
    compute_assumption,
    gemm_dtype,
    gpu_kernels,
    head_seconds,
    optimizer_seconds,
)
from pretrain.launcher.plan.memory import (
    dispatch_padding,
    rank_layers,
    stage_experts,
    stage_params,
    weight_versions,
)
from pretrain.launcher.plan.muon_work import muon_work
from pretrain.launcher.plan.pipeline.schedule_sim import SIMULATED, bubble_fraction
from pretrain.models.flops import ParamCount, count_params, flops_per_token

LINK_EFFICIENCY = 0.8
"""Share of a link's nominal bandwidth that NCCL collectives reach (bus bandwidth)."""
OVERLAP_SLOWDOWN = 0.189
"""How much slower compute runs while a collective overlaps it: the collective's kernels
hold SMs and memory bandwidth (Lee et al. 2025, "Characterizing Compute-Communication
Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114: an average
computational slowdown of 18.9% over GPT and LLaMA models on A100, H100, MI250 and MI210).
Traffic that overlaps compute costs this share of its overlapped time; the rest is exposed."""


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


def overlapped(traffic: float, window: float) -> float:
    """Seconds that `traffic` seconds of a collective add to a step when it overlaps a
    `window` of compute: the part beyond the window, and OVERLAP_SLOWDOWN of the part within
    (the compute it slows)."""
    hidden = min(traffic, window)
    return traffic - hidden + OVERLAP_SLOWDOWN * hidden


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
    return None if table is None else with_recipe_links(cfg, table)


def with_recipe_links(cfg: RecipeConfig, table: Links) -> Links:
    """`table` with the recipe's `hardware.*` figures over it."""
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


@dataclass(frozen=True)
class RankCompute:
    """One pipeline rank's compute for one micro-batch, in seconds."""

    forward: float
    backward: float
    """Backward and recomputation: what the gradient reduction overlaps."""
    attention: float
    """Per block held, the attention kernel's forward + backward (averaged over the blocks)."""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def rank_compute(
    cfg: RecipeConfig, degrees: Degrees, kernels: Kernels, pp_rank: int
) -> RankCompute:
    """Seconds of one micro-batch's blocks on `pp_rank` (`pretrain.launcher.plan.compute`),
    the LM head and loss on the last rank."""
    p, m = cfg.parallel, cfg.model
    held = rank_layers(cfg, pp_rank)
    # Blocks alike in kind (MoE or dense, recomputed or not) cost alike: one each is priced.
    kinds = collections.Counter(
        (m.is_moe_layer(layer), is_recomputed(cfg.recompute, layer)) for layer in held
    )
    forward = backward = attention = 0.0
    rerun = reruns_compiled_backward(cfg)
    for (moe, recomputed), count in kinds.items():
        block = _block(cfg, degrees, kernels, moe, recomputed)
        forward += count * block.forward
        backward += count * (block.backward + block.recompute)
        attention += count * block.attention
        if rerun and not moe:
            backward += count * block.backward
    if pp_rank == head_rank(p.pp, p.vpp, placement(p.pp_schedule) if p.pp > 1 else "loop"):
        tokens = cfg.train.micro_batch * cfg.train.seq_len / degrees.cp
        head_forward, head_backward = head_seconds(kernels, cfg, tokens, degrees.tp)
        forward, backward = forward + head_forward, backward + head_backward
        if m.mtp_layers:
            # Each depth: its projection of [embedding; hidden], a dense block and the head.
            block = _block(cfg, degrees, kernels, False, False)
            dtype = gemm_dtype(cfg)
            proj = kernels.gemm(tokens, m.dim, 2 * m.dim, dtype)
            forward += m.mtp_layers * (proj + block.forward + head_forward)
            backward += m.mtp_layers * (2 * proj + block.backward + head_backward)
    return RankCompute(forward, backward, attention / max(1, len(held)))


def reruns_compiled_backward(cfg: RecipeConfig) -> bool:
    """Whether compiled dense blocks run their backward twice per micro-batch: under a
    schedule that splits it into input and weight passes, each pass runs a compiled block's
    one backward node whole (parallel/compile.py; counted with torch's profiler)."""
    p, k = cfg.parallel, cfg.compile
    return splits_backward(p.pp, p.pp_schedule) and k.enabled and k.blocks


def _block(
    cfg: RecipeConfig, degrees: Degrees, kernels: Kernels, moe: bool, recomputed: bool
) -> BlockSeconds:
    """A block's seconds per micro-batch, priced once per distinct shape on `kernels`."""
    m, p = cfg.model, cfg.parallel
    key = (
        id(m), m.dim, m.n_heads, m.kv_heads, m.head_dim, m.ffn_dim, m.mlp, m.attention,
        m.vocab_size, m.moe_experts, m.moe_top_k, m.expert_ffn_dim, m.moe_shared_experts,
        m.sliding_window, moe, recomputed, cfg.recompute.policy, cfg.train.micro_batch,
        cfg.train.seq_len, degrees.tp, degrees.cp, degrees.ep, degrees.etp, p.sp,
        cfg.precision.dtype, cfg.precision.fp8_emulate, cfg.precision.fp8_backend,
        cfg.precision.fp8_recipe, m.moe_capacity_factor,
    )  # fmt: skip
    cached = kernels.blocks.get(key)
    # The model itself rides along: an id is only unique while its object lives.
    if cached is None or cached[0] is not m:
        tokens = cfg.train.micro_batch * cfg.train.seq_len / degrees.cp
        work = block_work(m, moe, degrees, p.sp, dispatch_padding(cfg), fp8_experts(cfg.precision))
        cached = (m, block_seconds(kernels, cfg, degrees, work, tokens, recomputed))
        kernels.blocks[key] = cached
    return cached[1]


def step_cost(
    cfg: RecipeConfig,
    degrees: Degrees,
    microbatches: int,
    peak_tflops: float,
    links: Links,
    kernels: Kernels | None = None,
) -> StepCost:
    """Estimated seconds per optimizer step of `cfg`'s layout (see the module's model);
    `kernels` defaults to the GPU table's for `cfg.cluster.gpu_type` at `peak_tflops`."""
    p, t, pp = cfg.parallel, degrees.tp, degrees.pp
    gpn = cfg.cluster.gpus_per_node
    seq, b, c = cfg.train.seq_len, cfg.train.micro_batch, COMPUTE_BYTES[cfg.precision.dtype]
    kernels = kernels or gpu_kernels(cfg, peak_tflops)
    activation = seq // degrees.cp * b * cfg.model.dim * c

    work = [rank_compute(cfg, degrees, kernels, r) for r in range(pp)]
    host = host_seconds(cfg, degrees, microbatches, kernels)
    # On a CPU the host's work is the computation's; a GPU's host runs ahead of the kernels
    # it launches, so the slower of the two paces the step.
    if cfg.cluster.device == "cpu":
        compute = [w.total + host for w in work]
    else:
        compute = [max(w.total, host) for w in work]
    etp_time = _etp_all_reduces(cfg, degrees, links)
    tp_time = [
        _tensor_parallel(cfg, degrees, links, r, kernels.tp_call_s) + etp_time[r] for r in range(pp)
    ]
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

    ring = _ring(cfg, degrees, links, microbatches, [w.attention for w in work])
    per_rank = [compute[r] + tp_time[r] + ring[r] + a2a[r] + p2p for r in range(pp)]
    slowest = max(range(pp), key=lambda r: per_rank[r])
    fill_drain = (sum(per_rank) - per_rank[slowest]) / chunks
    if p.pp_schedule in SIMULATED and pp > 1:
        fraction = bubble_fraction(p.pp_schedule, pp, microbatches, p.vpp, segment_steps(cfg))
        fill_drain = microbatches * per_rank[slowest] * fraction / (1 - fraction)
    # The gradient reduction overlaps the last micro-batch's backward (recomputation included).
    last_backward = work[slowest].backward
    dp_total, dp_exposed = _data_parallel(
        cfg,
        degrees,
        microbatches,
        links,
        microbatches * compute[slowest],
        last_backward,
        work[slowest].forward,
    )
    # The optimizer updates every rank's shard after the last backward, the fullest rank last.
    counts = count_params(cfg.model)
    # The fullest optimizer shard: the first rank (embedding), the last (head) or the one
    # holding the most blocks.
    layer_counts = [len(rank_layers(cfg, r)) for r in range(pp)]
    fullest = {0, pp - 1, layer_counts.index(max(layer_counts))}
    optimizer = max(
        optimizer_seconds(kernels, cfg, _optimizer_params(cfg, degrees, r, counts)) for r in fullest
    )
    return StepCost(
        compute=microbatches * compute[slowest] + optimizer,
        tp=microbatches * tp_time[slowest],
        pp_p2p=microbatches * p2p + tied,
        bubble=fill_drain,
        dp_total=dp_total,
        dp_exposed=dp_exposed,
        cp=microbatches * ring[slowest],
        ep=microbatches * a2a[slowest],
        muon=_muon(cfg, degrees, links, kernels),
    )


def _muon(cfg: RecipeConfig, degrees: Degrees, links: Links, kernels: Kernels) -> float:
    """Seconds of Muon's orthogonalization on the busiest rank (`pretrain.launcher.plan.
    muon_work`): its Newton-Schulz FLOPs at the rate of a square GEMM of the model's width,
    its bytes over the data-parallel link (dp ranks are tp x cp apart), exposed."""
    work = muon_work(cfg, degrees)
    if work is None:
        return 0.0
    gpn = cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, degrees.tp * degrees.cp, degrees.dp)
    n = cfg.model.dim
    rate = 2.0 * n**3 / kernels.gemm(n, n, n, "bf16")
    return work.flops / rate + work.bytes / bandwidth


def _table_rates(gpu_type: str, peak_tflops: float) -> KernelRates:
    rates = hardware.kernel_rates(gpu_type)
    return rates or KernelRates(None, float("inf"), {"bf16": (1.0, (1, 1, 1))}, ((1, peak_tflops),))


def _optimizer_params(
    cfg: RecipeConfig, degrees: Degrees, pp_rank: int, counts: ParamCount
) -> float:
    """Parameters whose optimizer states one rank of `pp_rank` updates: the stage's dense
    ones over tp and its routed experts over ep, from ZeRO-1 on sharded as the trainer shards
    them (the memory model too): the dense ones over dp_shard (x cp under FSDP, which shards
    over dp_shard x cp; ZeRO-1's owners are dealt over dp_shard,
    parallel/data_parallel.py), the experts over the ranks holding the same ones."""
    blocks, root, _ = stage_params(cfg, pp_rank, counts)
    experts = stage_experts(cfg, pp_rank, counts)
    dense, routed = (blocks + root - experts) / degrees.tp, experts / degrees.ep
    zero = cfg.parallel.zero
    if zero >= 1:
        dense /= degrees.dp_shard * (degrees.cp if zero >= 2 else 1)
        routed /= max(1, degrees.dp // degrees.ep) * degrees.cp
    return dense + routed


def _tensor_parallel(
    cfg: RecipeConfig, degrees: Degrees, links: Links, pp_rank: int, call_s: float = 0.0
) -> float:
    """Per micro-batch, the seconds of pipeline rank `pp_rank`'s TP collectives
    (`tp_comm.rank_collectives`: each one's ring bytes over the tp group's bandwidth, and a
    latency per ring step: 2(t-1) for an all-reduce, t-1 for an all-gather or
    reduce-scatter; or, where a calibration measured what one costs beyond its bytes as
    DTensor issues it, `call_s` each)."""
    t = degrees.tp
    if t == 1:
        return 0.0
    gpn, p = cfg.cluster.gpus_per_node, cfg.parallel
    bandwidth = group_bandwidth(links, gpn, 1, t)
    step = group_latency(links, gpn, 1, t)
    last = pp_rank == head_rank(p.pp, p.vpp, placement(p.pp_schedule) if p.pp > 1 else "loop")
    calls = rank_collectives(cfg, degrees, rank_layers(cfg, pp_rank), pp_rank == 0, last)
    seconds = 0.0
    for kind, handed in calls:
        steps = 2 * (t - 1) if kind == "all_reduce" else t - 1
        seconds += wire_bytes(kind, t, handed) / bandwidth + (call_s or steps * step)
    return seconds


def _all_to_all(cfg: RecipeConfig, degrees: Degrees, links: Links) -> list[float]:
    """Per pipeline rank and micro-batch, the seconds of its MoE layers' expert all-to-alls
    (`pretrain.launcher.plan.comm.ep`; not overlapped: the experts wait for their rows)."""
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
    cfg: RecipeConfig, degrees: Degrees, links: Links, microbatches: int, attention: list[float]
) -> list[float]:
    """Per pipeline rank and micro-batch, the seconds of its layers' K/V ring traffic the
    attention scores do not hide (zeros without cp)."""
    comm = cp_communication(cfg, degrees)
    if comm is None:
        return [0.0] * degrees.pp
    gpn = cfg.cluster.gpus_per_node
    bandwidth = group_bandwidth(links, gpn, degrees.tp, degrees.cp)
    # Every hop waits for its predecessor: its latency is not hidden.
    hop_latency = sum(comm.hops.values()) * group_latency(links, gpn, degrees.tp, degrees.cp)
    ring = []
    for r in range(degrees.pp):
        layers = len(rank_layers(cfg, r))
        # Each layer's hops hide behind its attention, every micro-batch's.
        window = layers * attention[r] * microbatches
        exposed = overlapped(layers * comm.sent_bytes / bandwidth, window) / microbatches
        ring.append(exposed + layers * hop_latency)
    return ring


def _data_parallel(
    cfg: RecipeConfig,
    degrees: Degrees,
    microbatches: int,
    links: Links,
    compute: float,
    last_backward: float,
    first_forward: float,
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
    # ZeRO-3 gathers around every micro-batch's compute; a once-per-step gather must land
    # before the first micro-batch's forward needs each block, so it hides behind that one.
    gather_window = compute if cfg.parallel.zero == 3 else first_forward
    exposed = overlapped(reduce, last_backward) + overlapped(gather, gather_window) + after_step
    return reduce + gather + after_step, exposed


def host_seconds(cfg: RecipeConfig, degrees: Degrees, microbatches: int, kernels: Kernels) -> float:
    """Per micro-batch, the host's work a calibration measured (0 without one): each
    operator the layout's step dispatches at the framework's time per operator (those on
    DTensors at theirs, sharding propagation included), and each FSDP2 collective at its
    fixed cost."""
    seconds = kernels.fsdp_call_s * fsdp_calls(cfg, degrees, microbatches)
    if kernels.op_s and kernels.step_ops:
        ops, on_dtensors = kernels.step_ops(cfg)
        per_dtensor_op = kernels.dtensor_op_s or kernels.op_s
        seconds += (ops - on_dtensors) * kernels.op_s + on_dtensors * per_dtensor_op
    return seconds / microbatches


def fsdp_calls(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> int:
    """Collectives FSDP2 issues per step on the pipeline rank holding most units
    (parallel/data_parallel.py); 0 without FSDP. A unit is a block, a multi-token
    prediction module, a MoE layer's experts where they are sharded, or a stage chunk's root
    (embedding, final norm, head). Each reduce-scatters its gradient once per step
    (PipeDream-2BW: every micro-batch) and all-reduces it over dp_replicate under hybrid
    sharding; ZeRO-2 all-gathers each once per step, ZeRO-3 each in every micro-batch's
    forward and all but the roots again in its backward (a root stays gathered through it)."""
    p, m = cfg.parallel, cfg.model
    if not uses_fsdp(p, degrees):
        return 0
    style = placement(p.pp_schedule) if p.pp > 1 else "loop"
    experts_sharded = degrees.grad_replicas // degrees.ep > 1
    units, roots = 0, 1
    for r in range(p.pp):
        held = rank_layers(cfg, r)
        chunks = len(rank_stages(r, p.pp, p.vpp, style)) if p.pp > 1 else 1
        count = len(held) + chunks
        count += sum(m.is_moe_layer(layer) for layer in held) if experts_sharded else 0
        count += m.mtp_layers if r == head_rank(p.pp, p.vpp, style) else 0
        units, roots = max((units, roots), (count, chunks))
    syncs = microbatches if weight_versions(cfg) > 1 else 1
    reduces = units * syncs * (2 if degrees.dp_replicate > 1 else 1)
    gathers = microbatches * (2 * units - roots) if p.zero == 3 else units * syncs
    return reduces + gathers


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
    PipeDream-2BW reduces (and ZeRO-2 gathers) once per micro-batch.
    """
    gpn, c = cfg.cluster.gpus_per_node, COMPUTE_BYTES[cfg.precision.dtype]
    group = shard * replicate
    if group == 1 or params == 0:
        return 0.0, 0.0, 0.0
    # PipeDream-2BW accumulates no micro-batch without syncing: it reduces every one's
    # gradient (and ZeRO-2 gathers every one's weights).
    per_step = microbatches if weight_versions(cfg) > 1 else 1
    grads = 4 * params * per_step
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
    gathers = 2 * microbatches if zero == 3 else per_step
    gather = gathers * c * params * (shard - 1) / shard / shard_bw
    return reduce, gather, after_step


def predicted_mfu(cfg: RecipeConfig, step_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation of a step of `step_s` seconds: model FLOPs per second over
    the dense peak of every rank (recomputation is not counted, as in the trainer's MFU)."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    train = flops_per_token(cfg.model, cfg.train.seq_len).train
    return tokens * train / (world_size(cfg) * step_s * peak_tflops * 1e12)


def assumptions(
    gpu_type: str, links: Links, peak_tflops: float, dtype: str, kernels: Kernels | None = None
) -> list[str]:
    """The cost model's stated figures for a GPU, one line each."""
    k = kernels or Kernels({dtype: peak_tflops}, _table_rates(gpu_type, peak_tflops))
    return [
        compute_assumption(gpu_type, dtype, k),
        f"links at {LINK_EFFICIENCY:.0%} of nominal: {links.intra_node_gbs:g} GB/s inside a node, "
        f"{links.inter_node_gbs:g} GB/s per GPU between nodes; latency "
        f"{links.intra_node_latency_us:g} us / {links.inter_node_latency_us:g} us per step",
        "TP/SP collectives and pipeline sends exposed; DP traffic hidden in its window "
        "(gradients: the last micro-batch's backward; parameter gathers: the first "
        "micro-batch's forward, every micro-batch's compute under ZeRO-3), slowing the "
        f"compute it overlaps by {OVERLAP_SLOWDOWN:.1%}; ZeRO-2 gathers once per step, ZeRO-3 "
        "per micro-batch; ZeRO-1's parameter all-gather after the step exposed; routed "
        "experts over their own data-parallel group",
        "expert all-to-alls (dispatch, combine; forward, backward) exposed",
        "the pipeline at the pace of its slowest rank (its own blocks, the LM head on the "
        "last), the others' fill and drain once, divided by vpp when interleaved; the V "
        "schedules' and 2bw's simulated bubble",
        "context parallelism: each layer's K/V ring over the link its tp*cp ranks span, "
        f"hidden behind the layer's attention, slowing it by {OVERLAP_SLOWDOWN:.1%}",
    ]
