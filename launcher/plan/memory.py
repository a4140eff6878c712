"""Memory per rank, by category, as this trainer actually allocates it.

Pure arithmetic on a recipe (no torch). The peak of a step is the larger of two moments:

- the end of the last micro-batch's forward: parameters, gradients held across accumulation,
  optimizer states, saved activations of the micro-batches in flight, the transient
  unsharded or cast parameter copies, and the logits with the loss buffers;
- the optimizer step: parameters, gradients, optimizer states and the step's temporaries.

The trainer's bookkeeping (stated, because it differs from the ZeRO paper's):

- ZeRO-0 (DDP): FP32 parameters and FP32 gradients, plus DDP's FP32 bucket buffers (as large
  as the gradients: `gradient_as_bucket_view` is off). BF16 runs under autocast, which keeps
  a BF16 copy of every weight it casts from the forward until that layer's backward.
- ZeRO-1: the same, with optimizer states sharded over dp_shard (ZeroRedundancyOptimizer).
- ZeRO-2/3 (FSDP2): FP32 parameters, gradients and optimizer states sharded over dp_shard
  (hybrid sharding replicates them over dp_replicate); unsharded parameters in the compute
  dtype exist transiently (ZeRO-2 keeps every block unsharded from its forward to its
  backward, ZeRO-3 one block plus the prefetched next; the root's embedding, final norm
  and head stay unsharded through the step).
  Gradient accumulation without sync keeps FP32 unsharded gradients between micro-batches.
- TP: RMSNorm weights (and MLA's latent down-projections, and a MoE layer's router and
  shared experts) stay replicated; column-wise
  projections keep their all-gathered input under SP; the vocab-parallel loss keeps one more
  FP32 logits shard.
- Experts: split over ep, and each one's hidden width over etp (a MoE layer is otherwise
  whole on every tp rank); under ZeRO-2/3 also sharded over the dp*cp / ep ranks that hold
  the same experts. Expert-parallel dispatch sends padded slots: ceil(c s k / N) per sequence
  with a capacity factor c, `DROPLESS_SLOTS` times the mean load when dropless.
- Optimizer states: `state_tensors` per parameter of `optim.state_dtype`'s bytes (codes
  plus block scales for int8/int4); the in-repo optimizers (all but torch's FP32 AdamW and
  SGD) step parameter by parameter, with temporaries of the largest parameter (and Muon's
  gathered full matrix) instead of the foreach update's parameter-sized one.
- PP: each pipeline rank is modelled apart (its layers, the embedding on the first, the
  head and the logits of every micro-batch in flight on the last, the stage's output kept
  until its backward elsewhere); under 1F1B gradients exist from the first backward on, so
  the steady state's peak holds them; a stage that runs every forward before its first
  backward (GPipe; 1F1B's first stage given as many micro-batches as stages) peaks at its
  first backward without them or after it with them and one micro-batch fewer, whichever
  holds more.
  The V schedules (zbv, dualpipev) hold the first and the last stage on rank 0; their and
  2BW's micro-batches in flight come from the simulated schedule (the order that runs).
  PipeDream-2BW keeps two versions of a stage's weights, and both hold gradients while the
  previous step's last backwards run beside this step's (the optimizer states exist once).
  `peak_breakdown` is the largest rank's, which the plan and the fit check use.
- CP: every per-token tensor holds s/cp tokens; the ring's backward adds its key/value and
  gradient buffers and one chunk pair's working set (FlashAttention's repeated key heads
  and gradients, or where the ring computes FP32 tiles a query tile's scores,
  probabilities and their gradient).

`textbook_model_states` keeps the ZeRO paper's figures (2 + 2 + K bytes per parameter) as
the reference the unit tests cross-check; `korthikanti_layer_activations` the per-layer
activation formula of Korthikanti et al. 2022 for a GPT block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from pretrain.core import hardware
from pretrain.core.hardware import GIB
from pretrain.core.layout import Degrees, uses_fsdp
from pretrain.core.model_config import ModelConfig
from pretrain.core.optim_states import MOMENTS, state_bytes, state_tensors
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.recompute import recomputed_blocks
from pretrain.core.schedules import SCHEDULES, V
from pretrain.core.schema import OptimConfig, RecipeConfig
from pretrain.core.stages import (
    head_rank,
    placement,
    rank_layer_count,
    rank_layer_counts,
    rank_layer_indices,
)
from pretrain.launcher.plan.pipeline.schedule_sim import held_in_flight, simulate
from pretrain.models.flops import ParamCount, count_params

RING_QUERY_TILE = 256
"""Query rows the ring attention computes at once (parallel/ring_attention.py's QUERY_TILE)."""

CUDA_FIXED_GIB = 1.5
"""CUDA context, cuBLAS workspaces and NCCL buffers per GPU (typical, H100, NCCL 2.2x)."""
FRAGMENTATION = 0.05
"""Caching-allocator fragmentation, as a share of the tensors' peak (CUDA only)."""
DROPLESS_SLOTS = 2.0
"""A dropless expert-parallel dispatch's slots, as a multiple of the mean load per expert:
where they start (parallel/expert.py); they then follow the largest load with 25% headroom."""
CATEGORIES = ("params", "grads", "optimizer", "activations", "transients", "logits", "framework")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak, by category; `notes` say how each was counted."""

    params: float
    """Parameters resident on the rank (FP32 masters; sharded under ZeRO-3)."""
    grads: float
    """Gradients held at the peak, with DDP's bucket buffers."""
    optimizer: float
    """Optimizer states, plus the optimizer step's temporaries when the step is the peak."""
    activations: float
    """Saved activations of the micro-batches in flight, plus one block's recomputation."""
    transients: float
    """Transient parameter- or gradient-sized buffers: FSDP's unsharded parameters, autocast's
    casts, DDP's extra gradient buffer in a backward after no-sync accumulation."""
    logits: float
    """Logits, their FP32 copy, the log-softmax saved for backward and its gradient."""
    framework: float
    """Allowance: CUDA context, NCCL and allocator fragmentation (0 on CPU)."""
    peak_phase: str
    """'forward' or 'optimizer step': the moment the categories describe."""
    notes: dict[str, str] = field(default_factory=dict)
    optimizer_states: float = 0.0
    """The optimizer states alone (without the step's temporaries), at either moment."""
    host: float = 0.0
    """Host memory the rank's offloaded state takes (parallel.offload); not in `total`."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in CATEGORIES)

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def rows(self) -> list[tuple[str, float, str]]:
        """(category, bytes, how it was counted) in display order."""
        return [(name, getattr(self, name), self.notes.get(name, "")) for name in CATEGORIES]


def textbook_model_states(
    params: float,
    optim: str,
    zero: int,
    dp: int,
    dtype: str = "bf16",
    moments: int | None = None,
    moment_bytes: float = 4,
) -> tuple[float, float, float]:
    """ZeRO paper (Rajbhandari et al. 2020) bytes of (params, grads, optimizer states).

    Mixed precision: 2 B 16-bit params + 2 B 16-bit grads + K B of FP32 master weights and
    moments (AdamW K = 12); FP32: 4 B + 4 B + the moments alone. Stage 1 shards the
    optimizer states over dp, stage 2 the grads too, stage 3 the params too. `moments`
    overrides the optimizer's states per parameter (SGD without momentum keeps none), and
    `moment_bytes` their bytes (`optim.state_dtype`'s: codes plus block scales when low-bit).
    """
    mixed = dtype != "fp32"
    moments = MOMENTS[optim] if moments is None else moments
    param_bytes = grad_bytes = 2 if mixed else 4
    optimizer_bytes = moment_bytes * moments + (4 if mixed else 0)
    return (
        param_bytes * params / (dp if zero >= 3 else 1),
        grad_bytes * params / (dp if zero >= 2 else 1),
        optimizer_bytes * params / (dp if zero >= 1 else 1),
    )


def korthikanti_layer_activations(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, selective: bool = False
) -> float:
    """Bytes one GPT layer saves (16-bit, with dropout; Korthikanti et al. 2022, Table 2).

    sbh(10 + 24/t + 5as/(ht)) with TP; (sbh/t)(34 + 5as/h) with SP; selective recompute
    drops the 5as/h attention-core term.
    """
    core = 0.0 if selective else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + core)
    return s * b * h * (10 + (24 + core) / t)


def textbook_activations(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> float:
    """Korthikanti et al. 2022 activation bytes of pipeline rank 0 (the textbook figure the
    plan prints beside `memory_breakdown`): the per-layer formula on the rank's layers
    (16-bit, doubled for FP32; full recompute keeps only the 2sbh layer input of the blocks
    it recomputes) times the micro-batches in flight, plus one micro-batch of FP32 logits."""
    m, t = cfg.model, degrees.tp
    s, b = local_tokens(cfg), cfg.train.micro_batch
    selective = cfg.recompute.policy == "selective"
    per_layer = korthikanti_layer_activations(s, b, m.dim, m.n_heads, t, cfg.parallel.sp, selective)
    layer_input = 2 * s * b * m.dim / (t if cfg.parallel.sp else 1)
    layers = rank_layers(cfg, 0)
    kept = len(recomputed_blocks(cfg.recompute, layers)) if cfg.recompute.policy == "full" else 0
    stage = kept * layer_input + (len(layers) - kept) * per_layer
    scale = 2 if cfg.precision.dtype == "fp32" else 1
    logits = s * b * m.vocab_size * 4 / t
    flight = in_flight(cfg.parallel.pp_schedule, degrees.pp, microbatches, cfg.parallel.vpp)
    return stage * scale * flight + logits


def rank_layers(cfg: RecipeConfig, pp_rank: int) -> tuple[int, ...]:
    """Global indices of the layers pipeline rank `pp_rank` holds, over all its chunks."""
    p = cfg.parallel
    style = _style(cfg)
    return rank_layer_indices(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers, pp_rank, style)


def _style(cfg: RecipeConfig) -> str:
    """The pipeline's chunk placement ("v" under the V schedules, else "loop")."""
    return placement(cfg.parallel.pp_schedule) if cfg.parallel.pp > 1 else "loop"


def llama_block_activations(
    m: ModelConfig,
    s: int,
    b: int,
    compute: int,
    residual: int,
    t: int,
    sp: bool,
    policy: str,
    padding: float = 1.0,
    etp: int = 1,
) -> float:
    """Bytes one Llama block of models/llama.py saves for backward, per micro-batch.

    `compute` is the bytes of matmul outputs, `residual` of the residual stream (FP32 under
    autocast, whose additions promote). Head- and FFN-wide tensors split over tp; the norms'
    tensors split over tp only with sp. Column-parallel linears save their (gathered) input
    whole, as DTensor's sequence parallelism does. `padding` and `etp`: see `mlp_width`.
    """
    h = m.dim
    split, replicated, sdpa = attention_widths(m)
    width = mlp_width(m, padding, t, etp)
    seq = t if sp else 1
    if policy == "selective":
        # Only the checkpoint's input and the outputs of the matmuls are kept.
        mlp = selective_mlp_width(m, t)
        kept = residual * h / seq + compute * (split / t + mlp + replicated + 2 * h / seq)
        return s * b * kept
    # Each RMSNorm keeps its FP32 input, its inverse RMS and its normalized output (in the
    # residual dtype); the linears after it keep their input, one cast copy per linear under
    # autocast. Rotary embedding multiplies by constants and keeps nothing of q and k.
    casts = compute < 4 and residual == 4
    norms = 2 * ((4 + residual) * h + 4) / seq
    readers = 2 if m.is_mla else 3  # linears reading the attention norm's output
    linear_inputs = compute * h * ((readers + 2) if casts else 2)
    attention = (
        compute * sdpa  # rotated q, k and v, and the output, as SDPA keeps them
        + 4 * m.n_heads  # SDPA's log-sum-exp per head; wo's input is a view of the output
    ) / t
    if m.is_mla:
        # The latents' norms keep their FP32 input and normalized output (the up-projections'
        # input) on every TP rank.
        attention += (4 + compute) * (m.kv_rank + m.mla_q_rank) + 8
    mlp = compute * 4 * width  # w1 and w3 outputs, silu output, w2's input
    return s * b * (norms + linear_inputs + attention + mlp)


def stepped_per_parameter(optim: OptimConfig) -> bool:
    """Whether the optimizer steps one parameter at a time (the in-repo ones)."""
    return optim.name in ("lion", "muon") or (optim.name == "adamw" and optim.state_dtype != "fp32")


def moe_tp_replicated(m: ModelConfig) -> int:
    """Weights of one MoE layer beside its routed experts that tensor parallelism leaves
    whole on every rank (the layer is not split over tp): the router and the shared
    experts."""
    return m.dim * m.moe_experts + m.moe_shared_experts * 3 * m.dim * m.expert_ffn_dim


def tp_replicated(m: ModelConfig, tp: int = 1) -> int:
    """Weights of one block that tensor parallelism leaves whole on every rank: the norms,
    MLA's latent down-projections and their norms, and K and V when their heads are fewer
    than tp (parallel/tensor.py replicates them)."""
    if not m.is_mla:
        kv = m.kv_heads * m.head_dim
        replicated_kv = 2 * kv * (m.dim + (1 if m.attn_bias else 0)) if m.kv_heads < tp else 0
        return 2 * m.dim + replicated_kv
    latent = m.dim * (m.kv_rank + m.rope_dim) + m.kv_rank
    return 2 * m.dim + latent + m.mla_q_rank * (m.dim + 1)


def mtp_tp_replicated(m: ModelConfig, tp: int = 1) -> int:
    """Weights of the multi-token prediction modules that tensor parallelism leaves whole on
    every rank: per depth its norms and its projection of [embedding; hidden]
    (parallel/tensor.py), and its block's as `tp_replicated` counts them."""
    return m.mtp_layers * (3 * m.dim + 2 * m.dim * m.dim + tp_replicated(m, tp))


def block_vectors(m: ModelConfig) -> int:
    """1-D weights (norms) of one block."""
    return 2 * m.dim + (m.kv_rank + m.mla_q_rank if m.is_mla else 0)


def dispatch_padding(cfg: RecipeConfig) -> float:
    """Rows an expert-parallel dispatch sends per kept assignment (1 without EP)."""
    if cfg.parallel.ep == 1 or not cfg.model.moe_experts:
        return 1.0
    return cfg.model.moe_capacity_factor or DROPLESS_SLOTS


def mlp_width(m: ModelConfig, padding: float = 1.0, tp: int = 1, etp: int = 1) -> float:
    """The MLP's hidden width per token on one tp rank, averaged over the layers.

    A dense MLP is split over tp. A MoE layer is not: every tp rank runs its k routed
    experts, each split over etp, and the shared experts whole, and its dispatch keeps about
    five h-wide copies of each of the k assignments (gathered, sent, received, expert output,
    weighted), counted here as 5kh/4 of width; `padding` scales what runs on padded slots
    (the experts' hidden width and three of those copies).
    """
    k = m.moe_top_k
    moe = (k * padding / etp + m.moe_shared_experts) * m.expert_ffn_dim + (
        2 + 3 * padding
    ) * k * m.dim / 4
    layers = m.n_moe_layers
    # A one-input MLP (GeLU, squared ReLU) keeps half of SwiGLU's ffn-wide tensors.
    dense = (m.ffn_dim if m.mlp == "swiglu" else m.ffn_dim / 2) / tp
    return ((m.n_layers - layers) * dense + layers * moe) / m.n_layers


def selective_mlp_width(m: ModelConfig, tp: int = 1) -> float:
    """Per token, the MLP's matmul outputs selective recompute keeps (besides w2's, which
    `llama_block_activations` counts with wo's), averaged over the layers: a dense MLP's w1
    and w3 outputs (w1's alone for a one-input MLP), split over tp; in a MoE layer the
    router's logits and the shared experts' w1 and w3 outputs. The routed experts' grouped
    GEMMs are no matmul the policy keeps (parallel/recompute.py): they, and the dispatch
    around them, run again in the backward."""
    dense = (2 if m.mlp == "swiglu" else 1) * m.ffn_dim / tp
    moe = m.moe_experts + 2 * m.moe_shared_experts * m.expert_ffn_dim
    layers = m.n_moe_layers
    return ((m.n_layers - layers) * dense + layers * moe) / m.n_layers


def attention_widths(m: ModelConfig) -> tuple[int, int, int]:
    """Per token of one attention layer: (matmul output widths split over tp, replicated ones,
    the widths SDPA keeps: its query, key, value and output)."""
    if not m.is_mla:
        q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
        return q + 2 * kv, 0, 2 * q + 2 * kv
    qk, v = m.n_heads * m.qk_head_dim, m.n_heads * m.v_head_dim
    split = qk + m.n_heads * (m.nope_dim + m.v_head_dim)
    return split, m.kv_rank + m.rope_dim + m.mla_q_rank, 2 * qk + 2 * v


def head_activations(
    m: ModelConfig, s: int, b: int, compute: int, residual: int, t: int, sp: bool
) -> float:
    """Bytes the final norm and the LM head's input keep (the logits are counted apart)."""
    casts = compute < 4 and residual == 4
    norm = ((4 + residual) * m.dim + 4) / (t if sp else 1)
    return s * b * (norm + m.dim * (compute if casts else residual))


def in_flight(schedule: str, pp: int, microbatches: int, vpp: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in whole
    stages, counted on the order of the schedule torch runs (`schedule_sim.held_in_flight`):
    1F1B p - r on rank r; GPipe all m; interleaved 1F1B p + (p - 1 - 2r)/v; zero-bubble p on
    every rank (its weight gradients hold their inputs); the V schedules and 2BW from their
    simulated order."""
    if pp == 1:
        return 1.0
    return held_in_flight(schedule, pp, microbatches, rank, vpp)


def head_in_flight(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> float:
    """Micro-batches whose logits the rank of the last stage holds at once: its in-flight
    count, or with several chunks per rank (interleaved, the V schedules) that of its last
    chunk (the last stage) alone, on the simulated order."""
    p = cfg.parallel
    rank = head_rank(degrees.pp, p.vpp, placement(p.pp_schedule))
    if degrees.pp > 1 and p.vpp > 1:
        if placement(p.pp_schedule) != V and microbatches % degrees.pp == 0:
            # The last chunk's count settles in the first rounds: simulate four of them.
            microbatches = min(microbatches, 4 * degrees.pp)
        return _last_chunk_in_flight(p.pp_schedule, degrees.pp, microbatches, p.vpp, rank)
    return in_flight(p.pp_schedule, degrees.pp, microbatches, p.vpp, rank)


@lru_cache(maxsize=256)
def _last_chunk_in_flight(schedule: str, pp: int, microbatches: int, vpp: int, rank: int) -> float:
    """The simulated peak of micro-batches rank `rank` holds of its last chunk (a search
    asks again for every layout of the same pipeline)."""
    return simulate(schedule, pp, microbatches, vpp).peak_in_flight(rank, vpp - 1)


def weight_versions(cfg: RecipeConfig) -> int:
    """Copies of each stage's weights a rank holds: two under PipeDream-2BW."""
    p = cfg.parallel
    return SCHEDULES[p.pp_schedule].weight_versions if p.pp > 1 else 1


def local_tokens(cfg: RecipeConfig) -> int:
    """Tokens of each sequence one rank computes: all of them, or 1/cp under CP."""
    return cfg.train.seq_len // cfg.parallel.cp


def stage_params(
    cfg: RecipeConfig, pp_rank: int = 0, counts: ParamCount | None = None
) -> tuple[int, int, int]:
    """(blocks' params, root params, blocks) of pipeline rank `pp_rank`.

    The root holds the embedding on the first rank, the final norm and head on the rank of
    the last stage (the last rank; the first under a V schedule).
    `counts` saves recounting the model's parameters (`count_params(cfg.model)`).
    """
    counts = counts or count_params(cfg.model)
    p = cfg.parallel
    style = _style(cfg)
    blocks = rank_layer_count(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers, pp_rank, style)
    root = counts.embedding if pp_rank == 0 else 0
    mtp = 0
    if pp_rank == head_rank(p.pp, p.vpp, style):
        # A tied LM head on a separate last stage keeps its own copy of the embedding (in
        # a V too: the last stage is a chunk of its own beside the first), and so do the
        # MTP modules (sharing a tied head's).
        copy = counts.embedding if p.pp > 1 else 0
        head = counts.lm_head or copy
        if counts.mtp and counts.lm_head:
            head += copy
        root += counts.final_norm + head
        mtp = counts.mtp  # blocks and their norms and projections, counted as blocks'
    # MoE layers are spread evenly over the stages (exact with one stage).
    return counts.layers * blocks // cfg.model.n_layers + mtp, root, blocks


def stage_experts(cfg: RecipeConfig, pp_rank: int = 0, counts: ParamCount | None = None) -> int:
    """Routed-expert parameters among pipeline rank `pp_rank`'s blocks (what ep splits)."""
    counts = counts or count_params(cfg.model)
    blocks = stage_params(cfg, pp_rank, counts)[2]
    return counts.experts * blocks // cfg.model.n_layers if blocks else 0


def peak_breakdown(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> MemoryBreakdown:
    """The breakdown of the pipeline rank with the largest peak (the only one without PP)."""
    ranks = [
        memory_breakdown(cfg, degrees, microbatches, r)
        for r in candidate_ranks(cfg, degrees, microbatches)
    ]
    return max(ranks, key=lambda b: b.total)


def candidate_ranks(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> list[int]:
    """The pipeline ranks whose peak may be the largest: the first and the last, and of the
    middle ranks alike in layers, recomputed layers and gradients held, the one with the
    most micro-batches in flight (each category grows with it; the rest is equal)."""
    p, policy = cfg.parallel, cfg.recompute.policy
    best: dict[tuple, tuple[float, int]] = {}
    counts = rank_layer_counts(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers, _style(cfg))
    for r, layers in enumerate(counts):
        flight = in_flight(p.pp_schedule, degrees.pp, microbatches, p.vpp, r)
        recomputed = layers if policy == "full" else 0
        if policy == "full" and cfg.recompute.every > 1:
            recomputed = len(recomputed_blocks(cfg.recompute, rank_layers(cfg, r)))
        held = _accumulation(cfg, degrees, microbatches, flight) > 1
        key = (r if r in (0, degrees.pp - 1) else -1, layers, recomputed, held)
        if key not in best or flight > best[key][0]:
            best[key] = (flight, r)
    return sorted(r for _, r in best.values())


def state_floor(cfg: RecipeConfig, degrees: Degrees) -> float:
    """Bytes no micro-batch size or recompute policy takes off the peak: the FP32 parameters
    and optimizer states (and DDP's buckets) of the pipeline rank holding the most."""
    counts = rank_layer_counts(
        cfg.model.n_layers, degrees.pp, cfg.parallel.vpp, cfg.parallel.pp_layers, _style(cfg)
    )
    floor = 0.0
    for r in {0, degrees.pp - 1, counts.index(max(counts))}:
        params, _, buckets, optimizer = _model_states(_rank_shape(cfg, degrees, 1, r), {})
        floor = max(floor, weight_versions(cfg) * params + buckets + optimizer)
    return floor


def _accumulation(cfg: RecipeConfig, degrees: Degrees, microbatches: int, flight: float) -> int:
    """Micro-batches whose gradients a rank accumulates before the step (1: none held).

    Gradients live from a micro-batch's backward to the step: at the peak when accumulation
    runs micro-batches one after another, or when a pipeline's steady state runs a forward
    after its first backward (not under GPipe, whose first backward is its peak)."""
    if degrees.pp == 1:
        return microbatches
    fills_first = SCHEDULES[cfg.parallel.pp_schedule].warmup_hops is None
    steady = not fills_first and microbatches > flight
    return microbatches if steady else 1


@dataclass(frozen=True)
class _RankShape:
    """What every category of one pipeline rank's peak is counted from."""

    cfg: RecipeConfig
    degrees: Degrees
    pp_rank: int
    compute: int
    """Bytes of an activation or cast weight in the compute dtype."""
    fsdp: bool
    ddp: bool
    last: bool
    flight: float
    """Micro-batches whose activations the rank holds at its peak."""
    microbatches: int
    """Micro-batches of the step (the schedule's)."""
    accum: int
    """Micro-batches whose gradients accumulate before the step (1: none held)."""
    root_params: int
    blocks: int
    local: float
    """Dense parameters on the rank (tp-split, norms replicated), before ZeRO sharding."""
    per_block: float
    others: float
    """Of `local`, the parameters that are not a block's weight matrix (embedding, head,
    norms): Muon leaves them to AdamW's states."""
    expert_local: float
    """Routed-expert parameters on the rank (split over ep and etp)."""
    expert_fsdp: bool
    """Whether ZeRO-2/3 shards the experts over the dp / ep ranks holding the same ones."""
    expert_resident: float
    """Of `expert_local`, the FP32 share the rank keeps (sharded when `expert_fsdp`)."""
    shard: int
    """Ranks the FP32 parameters and gradients are sharded over."""
    opt_shard: int
    """Ranks the optimizer states are sharded over."""


def _rank_shape(cfg: RecipeConfig, degrees: Degrees, microbatches: int, pp_rank: int) -> _RankShape:
    # Context-parallel ranks reduce gradients with the data-parallel ones, and FSDP shards
    # over them too.
    t, n = degrees.tp, degrees.grad_replicas
    fsdp = uses_fsdp(cfg.parallel, degrees)
    last = pp_rank == head_rank(degrees.pp, cfg.parallel.vpp, _style(cfg))
    flight = in_flight(
        cfg.parallel.pp_schedule, degrees.pp, microbatches, cfg.parallel.vpp, pp_rank
    )
    accum = _accumulation(cfg, degrees, microbatches, flight)
    counts = count_params(cfg.model)
    block_params, root_params, blocks = stage_params(cfg, pp_rank, counts)
    m = cfg.model
    # Routed experts: split over ep and etp, not over tp; ZeRO-2/3 shard them over dp / ep too.
    experts = counts.experts * blocks // m.n_layers if blocks else 0
    block_params -= experts
    expert_local = experts / (degrees.ep * degrees.etp)
    expert_fsdp = fsdp and n > degrees.ep  # one rank per set of experts: not sharded
    # Norms (and MLA's latent down-projections) are replicated over tp; the rest is split.
    final_norm = m.dim if last else 0
    # MoE layers are spread evenly over the stages, as in `stage_params`.
    moe_whole = moe_tp_replicated(m) * m.n_moe_layers * blocks // m.n_layers if blocks else 0
    replicated = tp_replicated(m, t) * blocks + final_norm + moe_whole
    # The MTP modules' norms and projection stay whole on every tp rank (parallel/tensor.py).
    replicated += mtp_tp_replicated(m, t) if last else 0
    return _RankShape(
        cfg=cfg,
        degrees=degrees,
        pp_rank=pp_rank,
        compute=COMPUTE_BYTES[cfg.precision.dtype],
        fsdp=fsdp,
        # Under tp or pp, ZeRO-0/1 reduce through FSDP2's replicate: in place, no DDP buckets.
        ddp=not fsdp and n > 1 and t == 1 and degrees.pp == 1,
        last=last,
        flight=flight,
        microbatches=microbatches,
        accum=accum,
        root_params=root_params,
        blocks=blocks,
        local=(block_params + root_params - replicated) / t + replicated,
        per_block=block_params / blocks / t if blocks else 0.0,
        # Under Muon, what is not a block's weight matrix keeps AdamW's states.
        others=(root_params - final_norm) / t + block_vectors(m) * blocks + final_norm,
        expert_local=expert_local,
        expert_fsdp=expert_fsdp,
        expert_resident=expert_local / (n // degrees.ep if expert_fsdp else 1),
        # Hybrid sharding replicates over dp_replicate: state is split over dp_shard (x cp)
        # only.
        shard=degrees.dp_shard * degrees.cp if fsdp else 1,
        opt_shard=degrees.dp_shard * (degrees.cp if fsdp else 1)
        if fsdp or cfg.parallel.zero == 1
        else 1,
    )


def memory_breakdown(
    cfg: RecipeConfig, degrees: Degrees, microbatches: int, pp_rank: int = 0
) -> MemoryBreakdown:
    """Peak bytes per rank of pipeline rank `pp_rank` under `cfg`, by category."""
    r = _rank_shape(cfg, degrees, microbatches, pp_rank)
    first = _shape_breakdown(r)
    if degrees.pp == 1 or r.accum > 1 or r.microbatches < 2 or r.flight < 2:
        return first
    # A stage that runs every micro-batch's forward before its first backward (GPipe, or
    # as many micro-batches as stages on the first) holds no gradient at the end of its
    # forwards; from its first backward on it holds them, beside one micro-batch fewer.
    after = _shape_breakdown(dataclasses.replace(r, flight=r.flight - 1, accum=r.microbatches))
    if after.total <= first.total:
        return first
    after.notes["activations"] += " (after the first backward)"
    return after


def _shape_breakdown(r: _RankShape) -> MemoryBreakdown:
    """The peak of the rank `r` describes, by category."""
    cfg, degrees = r.cfg, r.degrees
    notes: dict[str, str] = {}
    params, grads_held, buckets, optimizer = _model_states(r, notes)
    transients = _transients(r, notes)
    logits, logits_backward = _logits(r, notes)
    activations = _peak_activations(r, logits_backward, notes)
    if r.expert_local:
        params += 4 * r.expert_resident
        # ZeRO-1 shards the experts' states over the ranks holding the same experts.
        zero1 = cfg.parallel.zero == 1 and degrees.dp_shard > 1
        expert_shard = max(1, degrees.grad_replicas // degrees.ep) if zero1 else 1
        expert_states = state_tensors(cfg.optim)[0] * r.expert_resident / expert_shard
        optimizer += state_bytes(cfg.optim.state_dtype) * expert_states
        grads_held += 4 * r.expert_local if r.accum > 1 else 0.0
        unsharded = (r.expert_fsdp and cfg.parallel.zero == 2) or (
            not r.expert_fsdp and cfg.precision.dtype != "fp32"
        )
        transients += r.compute * r.expert_local if unsharded else 0.0
        etp = f" x etp={degrees.etp}" if degrees.etp > 1 else ""
        notes["params"] += f", experts split over ep={degrees.ep}{etp}" + (
            f" and dp*cp/ep={degrees.grad_replicas // degrees.ep}" if r.expert_fsdp else ""
        )
    versions = weight_versions(cfg)
    if versions > 1:
        # PipeDream-2BW: a second copy of the stage, and gradients in both while the previous
        # step's last backwards run beside this step's (reduce-scattered each micro-batch
        # under FSDP, so sharded); both versions' unsharded or cast weights are in use.
        params *= versions
        grads_held = versions * 4 * (r.local / r.shard + r.expert_local)
        transients *= versions
        notes["params"] += ", x2 weight versions (2BW)"
        notes["grads"] += ", in both weight versions (2BW)"
    # The optimizer step: FP32 gradients (sharded under FSDP) and the update's temporaries.
    step_grads = 4 * r.local / r.shard + (4 * r.local if r.ddp else 0.0) + 4 * r.expert_resident
    step_grads *= versions
    step_temp = _step_temporaries(cfg, degrees, r.local / r.opt_shard + r.expert_resident)
    host = 0.0
    if cfg.parallel.offload == "params" and r.fsdp:
        params, optimizer, step_grads, step_temp, host = _offload(
            r, params, optimizer, step_grads, step_temp, notes
        )
    forward = (params, grads_held + buckets, optimizer, activations, transients, logits)
    step = (params, step_grads, optimizer + step_temp, 0.0, 0.0, 0.0)
    phase, chosen = ("forward", forward) if sum(forward) >= sum(step) else ("optimizer step", step)
    framework = 0.0
    if cfg.cluster.device == "cuda":
        framework = CUDA_FIXED_GIB * GIB + FRAGMENTATION * sum(chosen)
        notes["framework"] = f"{CUDA_FIXED_GIB:g} GiB + {FRAGMENTATION:.0%} fragmentation"
    else:
        notes["framework"] = "none counted on CPU"
    return MemoryBreakdown(
        *chosen,
        framework=framework,
        peak_phase=phase,
        notes=notes,
        optimizer_states=optimizer,
        host=host,
    )


def _step_temporaries(cfg: RecipeConfig, degrees: Degrees, stepped: float) -> float:
    """Bytes the optimizer step allocates besides the states, for `stepped` local parameters:
    torch's foreach AdamW (and SGD) one FP32 copy of them all; the in-repo optimizers four
    FP32 tensors the size of the largest parameter (Muon: of the full matrix it gathers)."""
    if not any(state_tensors(cfg.optim)):
        return 0.0
    if not stepped_per_parameter(cfg.optim):
        return 4 * stepped
    m = cfg.model
    largest = max(m.dim * m.ffn_dim, m.dim * m.n_heads * m.qk_head_dim, m.dim * m.vocab_size)
    if m.moe_experts:
        experts = m.moe_experts // degrees.ep * m.dim * m.expert_ffn_dim // degrees.etp
        largest = max(largest, experts)
    return 4 * 4 * largest


def _offload(
    r: _RankShape,
    params: float,
    optimizer: float,
    step_grads: float,
    step_temp: float,
    notes: dict[str, str],
) -> tuple[float, float, float, float, float]:
    """parallel.offload=params: the FP32 shards, their gradients, the optimizer states and
    its step move to the host; the device keeps the rotary tables and expert weights.
    Returns the device's (params, optimizer, step gradients, step temporaries) and the
    host's peak (the optimizer step)."""
    experts = 4 * r.expert_resident
    experts_temp = _step_temporaries(r.cfg, r.degrees, r.expert_resident) if experts else 0.0
    expert_states = state_bytes(r.cfg.optim.state_dtype) * (
        state_tensors(r.cfg.optim)[0] * r.expert_resident
    )
    sharded = 4 * r.local / r.shard
    dense_states = optimizer - expert_states
    host = sharded + dense_states + (step_grads - experts) + (step_temp - experts_temp)
    notes["params"] += "; FP32 shards offloaded to the host"
    notes["optimizer"] += "; on the host"
    return params - sharded, expert_states, experts, experts_temp, host


def _model_states(r: _RankShape, notes: dict[str, str]) -> tuple[float, float, float, float]:
    """(params, gradients held at the forward's end, DDP buckets, optimizer states), dense."""
    m, degrees = r.cfg.model, r.degrees
    rope = 2 * m.max_seq_len * (m.rope_dim // 2) * 4
    params = 4 * r.local / r.shard + rope
    notes["params"] = (
        f"FP32 {f'sharded over dp_shard={r.shard}' if r.shard > 1 else 'replicated'}"
        + ", + rotary tables"
    )
    if degrees.pp > 1:
        notes["params"] += f", pipeline rank {r.pp_rank} of {degrees.pp}"
    on_matrices, on_others = state_tensors(r.cfg.optim)
    states = on_matrices * (r.local - r.others) + on_others * r.others
    optimizer = state_bytes(r.cfg.optim.state_dtype) * states / r.opt_shard
    notes["optimizer"] = (
        f"{on_matrices}/{on_others} {r.cfg.optim.state_dtype} state(s) per matrix/other param"
        + (f", sharded over {r.opt_shard}" if r.opt_shard > 1 else "")
    )
    # FSDP's no-sync accumulation holds FP32 unsharded gradients between micro-batches.
    grads_held = 4 * r.local if r.accum > 1 else 0.0
    buckets = 4 * r.local if r.ddp else 0.0
    notes["grads"] = (
        "FP32"
        + (", + DDP buckets" if r.ddp else "")
        + (", held unsharded across micro-batches" if r.fsdp and r.accum > 1 else "")
    )
    return params, grads_held, buckets, optimizer


def _transients(r: _RankShape, notes: dict[str, str]) -> float:
    """Parameter copies alive at the end of forward, and DDP's accumulation buffer."""
    zero = r.cfg.parallel.zero
    if r.fsdp and zero == 2:
        transients = r.compute * r.local
        notes["transients"] = "every block and the root unsharded (ZeRO-2)"
    elif r.fsdp:
        # At the start of backward only the root is unsharded; a block's all-gather (and the
        # prefetched next) comes once the logits' buffers are freed, and is smaller.
        transients = r.compute * r.root_params / r.degrees.tp
        notes["transients"] = "the root unsharded (ZeRO-3)"
    elif r.cfg.precision.dtype != "fp32":
        transients = r.compute * r.local
        notes["transients"] = "autocast's BF16 weight casts"
    else:
        transients = 0.0
    # Measured on CPU: DDP's synced backward after no-sync micro-batches holds one more
    # FP32 gradient-sized buffer, and so does FSDP2's replicate (its reduction's flat copy).
    if not r.fsdp and r.degrees.grad_replicas > 1 and r.accum > 1:
        transients += 4 * r.local
        kind = "DDP's accumulation buffer" if r.ddp else "the replicated reduction's buffer"
        notes["transients"] = notes.get("transients", "") + f" + {kind}"
    return transients


def _logits(r: _RankShape, notes: dict[str, str]) -> tuple[float, float]:
    """(logit bytes at the peak, the part the start of backward holds for one micro-batch)."""
    t = r.degrees.tp
    s, b, v = local_tokens(r.cfg), r.cfg.train.micro_batch, r.cfg.model.vocab_size
    # Per micro-batch in flight the last stage keeps the logits and the FP32 log-softmax
    # (the vocab-parallel loss one more FP32 shard); the start of backward adds its gradient
    # and the gradient of the logits (in FP32 before the cast back).
    # The MTP depths' logits come with the next-token ones, along the batch.
    rows = s * b * (1 + r.cfg.model.mtp_layers)
    kept_logits = rows * v / t * (r.compute + 4 + (4 if t > 1 else 0)) if r.last else 0.0
    logit_grads = rows * v / t * 8 if r.last else 0.0
    chunks = r.cfg.train.loss_chunks
    if chunks > 1:
        # Chunked loss: no micro-batch keeps logits; one chunk's exist at a time, in the
        # forward and again when backward recomputes it.
        notes["logits"] = f"one of {chunks} chunks: logits, log-softmax, 2 FP32 gradients"
        if not r.last:
            notes["logits"] = "on the last stage"
        one_chunk = (kept_logits + logit_grads) / chunks
        return one_chunk, one_chunk
    flight = head_in_flight(r.cfg, r.degrees, r.microbatches) if r.last else r.flight
    notes["logits"] = (
        "logits, log-softmax, 2 FP32 gradients"
        + (f", x{flight:g} in flight" if flight != 1 else "")
        if r.last
        else "on the last stage"
    )
    return flight * kept_logits + logit_grads, kept_logits + logit_grads


def _peak_activations(r: _RankShape, logits_backward: float, notes: dict[str, str]) -> float:
    """Saved activations, plus what a block's backward adds over the logits' moment."""
    activations, recomputed_block, note = _activations(
        r.cfg, r.degrees, r.flight, r.pp_rank, r.fsdp
    )
    # Later in backward the logits' buffers are gone and a block's backward holds its
    # gradient temporaries (and, recomputed, its activations again; under ZeRO-3 that block
    # and the prefetched next unsharded, and the block's unsharded FP32 gradients): the
    # peak holds the larger of the two moments.
    zero3 = r.fsdp and r.cfg.parallel.zero == 3
    block_work = 2 * r.compute * r.per_block + 4 * r.per_block if zero3 else 0
    backward = recomputed_block + block_work + _block_backward(r.cfg, r.degrees, r.compute, r.fsdp)
    if r.blocks and backward > logits_backward:
        activations += backward - logits_backward
        note += ", + one block's backward" + (" recomputing" if recomputed_block else "")
    notes["activations"] = note
    return activations


def residual_bytes(cfg: RecipeConfig, fsdp: bool) -> int:
    """Bytes per element of the residual stream (and the norms' outputs): autocast leaves it
    in FP32, FSDP's BF16 parameters keep it BF16."""
    return 4 if cfg.precision.dtype == "fp32" or not fsdp else COMPUTE_BYTES[cfg.precision.dtype]


def _block_backward(cfg: RecipeConfig, degrees: Degrees, compute: int, fsdp: bool) -> float:
    """Gradient temporaries of a block's MLP backward: the incoming residual gradient and
    three hidden-wide gradients (of w2's input and of the gate and up outputs)."""
    t, sp = degrees.tp, cfg.parallel.sp
    per_token = residual_bytes(cfg, fsdp) * cfg.model.dim / (t if sp else 1)
    per_token += 3 * compute * mlp_width(cfg.model, dispatch_padding(cfg), t, degrees.etp)
    tokens, b = local_tokens(cfg), cfg.train.micro_batch
    return tokens * b * per_token + _ring_backward(cfg, degrees, compute)


def ring_fused(cfg: RecipeConfig) -> bool:
    """Whether the job's ring runs the device's flash attention on its chunk pairs
    (`hardware.fused_ring_attention`, which the trainer asks too); otherwise it computes
    FP32 tiles. Attention runs in 16 bits in every precision but FP32."""
    half = cfg.precision.dtype != "fp32"
    head = cfg.model.qk_head_dim
    return hardware.fused_ring_attention(cfg.cluster.device, half, head, cfg.data.doc_mask)


def _ring_backward(cfg: RecipeConfig, degrees: Degrees, compute: int) -> float:
    """Context parallelism's backward temporaries, 0 without cp: the keys and values
    received with their FP32 gradient accumulators (held and incoming), and one chunk
    pair's working set. Fused: the key and value heads repeated per query head, the kernel's
    three gradients in the compute dtype and the FP32 copies of dq, dk and dv. Tiled: one
    query tile's FP32 scores, probabilities and their gradient over a chunk."""
    if degrees.cp == 1:
        return 0.0
    m, b, t = cfg.model, cfg.train.micro_batch, degrees.tp
    chunk = local_tokens(cfg) / 2
    if ring_fused(cfg):
        per_head = b * m.n_heads / t * chunk * m.qk_head_dim
        pair = per_head * (5 * compute + 3 * 4)
    else:
        pair = 3 * 4 * b * m.n_heads / t * min(chunk, RING_QUERY_TILE) * chunk
    kv = 2 * b * local_tokens(cfg) * m.kv_heads * m.head_dim / t
    return pair + kv * (compute + 2 * 2 * 4)


def _activations(
    cfg: RecipeConfig, degrees: Degrees, flight: float, pp_rank: int, fsdp: bool
) -> tuple[float, float, str]:
    """Saved activations of pipeline rank `pp_rank` with `flight` micro-batches in flight,
    one recomputed block's activations (0 without recompute), and how they were counted."""
    m, t, sp = cfg.model, degrees.tp, cfg.parallel.sp
    s, b = local_tokens(cfg), cfg.train.micro_batch
    compute, residual = COMPUTE_BYTES[cfg.precision.dtype], residual_bytes(cfg, fsdp)
    p = cfg.parallel
    style = _style(cfg)
    blocks = rank_layer_count(m.n_layers, p.pp, p.vpp, p.pp_layers, pp_rank, style)
    policy = cfg.recompute.policy
    pad = dispatch_padding(cfg)
    etp = degrees.etp
    whole = llama_block_activations(m, s, b, compute, residual, t, sp, "none", pad, etp)
    kept_input = s * b * m.dim * residual / (t if sp else 1)
    if policy == "selective":
        kept = llama_block_activations(m, s, b, compute, residual, t, sp, "selective", pad, etp)
        stage = blocks * kept
        note = "selective: matmul outputs kept"
    elif policy == "full":
        recomputed = len(recomputed_blocks(cfg.recompute, rank_layers(cfg, pp_rank)))
        kept = kept_input
        stage = recomputed * kept_input + (blocks - recomputed) * whole
        note = f"full on {recomputed}/{blocks} blocks: inputs kept"
    else:
        kept = whole
        stage = blocks * whole
        note = "every block's saved tensors"
    if pp_rank == head_rank(degrees.pp, p.vpp, style):
        head = head_activations(m, s, b, compute, residual, t, sp)
        # Each MTP depth keeps its block's as the policy leaves a block's (its block is
        # recomputed under either policy) and its norm's for the head.
        stage += head + m.mtp_layers * (kept + head)
        if m.mtp_layers:
            note += f", + {m.mtp_layers} MTP module(s)"
    else:
        # The stage's output, kept by the schedule from its send until its backward.
        stage += s * b * m.dim * residual / (t if sp else 1)
        note += ", + the stage's output"
    if flight != 1:
        note += f", x{flight:g} micro-batches in flight"
    return stage * flight, whole if policy != "none" else 0.0, note


def fits(breakdown: MemoryBreakdown, device_gib: float | None) -> bool:
    """Whether the peak fits the device memory (no limit when there is none, e.g. on CPU)."""
    return not device_gib or breakdown.total_gib <= device_gib
