"""The plan: pure arithmetic on a valid recipe, before anything runs.

Layout and rank groups, parameter counts per rank, FLOPs per token (the same `models.flops`
functions the trainer's MFU uses), pipeline bubble, a first memory estimate per rank and an
expected step time. Every assumption behind a number is listed in `Plan.assumptions`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from launcher import schedule_sim
from launcher.cp_comm import CPComm, cp_communication
from launcher.memory import MemoryBreakdown, peak_breakdown
from launcher.memory import in_flight as rank_in_flight
from launcher.tp_comm import TPComm, tp_communication
from models.flops import count_params, flops_per_token
from pretrain_core import hardware
from pretrain_core.layout import Degrees, grad_accum_steps, rank_groups, resolve_degrees
from pretrain_core.precision import peak_dtype
from pretrain_core.schema import OptimConfig, RecipeConfig
from pretrain_core.stages import V_SCHEDULES

MFU_ASSUMPTION = 0.40
"""Model FLOPs utilisation assumed for the expected step time."""
LONG_CONTEXT = 16384
"""Sequences from this length on are long: context parallelism is among the fixes the plan
and the layout search offer."""
GROUPS_SHOWN = 4
"""Rank groups kept per dim in a plan; the rest are counted."""
GIB = 2**30


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of parameters, gradients and optimizer states under one ZeRO stage."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass
class Plan:
    """Everything `action=plan` reports about a recipe."""

    name: str
    degrees: Degrees
    rank_groups: dict[str, list[list[int]]]
    """The first `GROUPS_SHOWN` groups of each dim."""
    rank_group_counts: dict[str, int]
    params_total: int
    params_non_embedding: int
    params_active: int
    """Parameters one token runs through (all of them for a dense model)."""
    params_first_stage: int
    params_last_stage: int
    params_per_rank: int
    """The largest stage's parameters split over tp."""
    flops_per_token_forward: int
    flops_per_token_train: int
    """Forward + backward: what MFU counts."""
    flops_per_token_hardware: int
    """Train FLOPs plus recomputation: what HFU counts."""
    tokens_per_step: int
    grad_accum: int
    pp_microbatches: int
    bubble_fraction: float
    zero: int
    model_states_by_zero: dict[int, ModelStates]
    """Bytes per rank under ZeRO stages 0-3 (the recipe uses `zero`)."""
    activations: float
    """Bytes per rank of activations (peak micro-batches in flight)."""
    gpu_type: str
    gpu_memory_gib: float | None
    peak_tflops: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    memory: MemoryBreakdown | None = None
    """Peak bytes per rank by category as this trainer allocates them (launcher/memory.py)."""
    assumptions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tp_comm: TPComm | None = None
    """One layer's tensor-parallel collectives per step and rank (None without TP)."""
    pipeline: dict | None = None
    """The simulated schedule: chart, bubble, in-flight per stage (None without PP)."""
    cp_comm: CPComm | None = None
    """One layer's context-parallel ring exchanges per step and rank (None without CP)."""

    @property
    def memory_gib(self) -> float:
        """Model states under the recipe's ZeRO stage plus activations, in GiB per rank."""
        return (self.model_states_by_zero[self.zero].total + self.activations) / GIB


def make_plan(cfg: RecipeConfig) -> Plan:
    """Plan a recipe that passes `validate` (RecipeError from the layout otherwise)."""
    degrees = resolve_degrees(cfg)
    accum = grad_accum_steps(cfg)
    micro = cfg.parallel.pp_microbatches or accum
    groups = rank_groups(degrees)
    counts = count_params(cfg.model)
    first, last = stage_params(cfg)
    # Routed experts are split over ep rather than tp (parallel/expert.py).
    experts = counts.experts // degrees.pp
    per_rank = math.ceil((max(first, last) - experts) / degrees.tp + experts / degrees.ep)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    fraction = recomputed_layers(cfg.model.n_layers, cfg.recompute.every) / cfg.model.n_layers
    on_gpu = cfg.cluster.device == "cuda"
    spec = hardware.gpu_spec(cfg.cluster.gpu_type if on_gpu else "cpu")
    peak = cfg.hardware.peak_tflops or spec.peak_tflops.get(peak_dtype(cfg.precision))
    tokens = cfg.train.global_batch * cfg.train.seq_len
    step_time = (
        tokens * fpt.train / (degrees.world * peak * 1e12 * MFU_ASSUMPTION) if peak else None
    )
    memory = (cfg.cluster.gpu_memory_gib or spec.memory_gib) if on_gpu else None
    plan = Plan(
        name=cfg.name,
        degrees=degrees,
        rank_groups={dim: g[:GROUPS_SHOWN] for dim, g in groups.items()},
        rank_group_counts={dim: len(g) for dim, g in groups.items()},
        params_total=counts.total,
        params_non_embedding=counts.non_embedding,
        params_active=counts.active,
        params_first_stage=first,
        params_last_stage=last,
        params_per_rank=per_rank,
        flops_per_token_forward=fpt.forward,
        flops_per_token_train=fpt.train,
        flops_per_token_hardware=fpt.with_recompute(cfg.recompute.policy, fraction),
        tokens_per_step=tokens,
        grad_accum=accum,
        pp_microbatches=micro,
        bubble_fraction=bubble_fraction(
            cfg.parallel.pp_schedule, degrees.pp, micro, cfg.parallel.vpp, segment_steps(cfg)
        ),
        zero=cfg.parallel.zero,
        model_states_by_zero={
            z: model_states(per_rank, cfg.precision.dtype, cfg.optim, z, degrees.dp_shard)
            for z in range(4)
        },
        activations=activation_bytes(cfg, degrees, micro),
        gpu_type=spec.name,
        gpu_memory_gib=memory,
        peak_tflops=peak,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time else None,
    )
    plan.memory = peak_breakdown(cfg, degrees, micro)
    plan.assumptions = _assumptions(cfg)
    plan.tp_comm = tp_communication(cfg, degrees)
    plan.cp_comm = cp_communication(cfg, degrees)
    if plan.cp_comm is not None and plan.cp_comm.crosses_nodes:
        plan.warnings.append(
            f"the context-parallel ring spans tp*cp = {plan.cp_comm.ring_span} ranks, more than "
            f"a node's {cfg.cluster.gpus_per_node}: every hop crosses the inter-node link"
        )
    if degrees.pp > 1:
        plan.pipeline = schedule_sim.summary(
            cfg.parallel.pp_schedule, degrees.pp, micro, cfg.parallel.vpp, segment_steps(cfg)
        )
    if memory and max(plan.memory_gib, plan.memory.total_gib) > memory:
        peak = max(plan.memory_gib, plan.memory.total_gib)
        fixes = "raise parallel.zero, tp or pp, lower train.micro_batch, or recompute"
        if cfg.train.seq_len >= LONG_CONTEXT:
            fixes = (
                "for a long sequence pull recompute, then sp (with tp), then parallel.cp, then "
                "a smaller train.micro_batch; or raise parallel.zero, tp or pp"
            )
        plan.warnings.append(
            f"estimated {peak:.1f} GiB per rank exceeds the {memory:g} GiB of {spec.name}: {fixes}"
        )
    return plan


def stage_params(cfg: RecipeConfig) -> tuple[int, int]:
    """Parameters of the first and the last pipeline stage (equal layers on every stage).

    The embedding sits on the first stage, the final norm and LM head on the last; a tied
    head on a separate last stage still holds its own copy of the embedding matrix.
    """
    counts = count_params(cfg.model)
    pp = cfg.parallel.pp
    layers = counts.layers * (cfg.model.n_layers // pp) // cfg.model.n_layers
    head = counts.lm_head or (counts.embedding if pp > 1 else 0)
    if pp == 1:
        return (counts.total,) * 2
    return counts.embedding + layers, layers + counts.final_norm + head


def segment_steps(cfg: RecipeConfig) -> int:
    """Steps PipeDream-2BW runs between two drains of its pipeline: a checkpoint drains it."""
    every = cfg.checkpoint.every
    return min(cfg.train.steps, every) if every > 0 else cfg.train.steps


def recomputed_layers(layers: int, every: int) -> int:
    """Blocks that recompute when every `every`-th block does, counting from the first."""
    return math.ceil(layers / every)


def bubble_fraction(
    schedule: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1
) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1), divided by vpp when interleaved.

    zero_bubble gets the 1F1B value, an upper bound: how much of it the split backward
    fills depends on the timing of each stage (see `Plan.assumptions`). The V schedules
    get their simulated value (F = B = W), and 2bw that of a segment of `steps` steps
    between two drains (the pipeline fills once per segment).
    """
    if pp == 1:
        return 0.0
    if schedule in V_SCHEDULES:
        return schedule_sim.simulate(schedule, pp, microbatches, vpp).bubble_fraction
    if schedule == "2bw":
        return schedule_sim.pipedream_bubble(pp, microbatches, steps)
    fraction = (pp - 1) / (microbatches + pp - 1)
    return fraction / vpp if schedule == "interleaved_1f1b" else fraction


def model_states(
    params: int, dtype: str, optim: OptimConfig, zero: int, dp_shard: int
) -> ModelStates:
    """Bytes of params, grads and optimizer states on one rank holding `params` parameters.

    bf16 follows the ZeRO paper's mixed-precision bookkeeping: 2 B bf16 params, 2 B bf16
    grads, and fp32 master weights plus the optimizer's fp32 moments (AdamW: 4+4+4 B).
    fp32 keeps 4 B params, 4 B grads and the moments alone (AdamW: 4+4 B). ZeRO-1 shards
    the optimizer states over dp_shard, ZeRO-2 the gradients too, ZeRO-3 the parameters too.
    """
    moments = {"adamw": 2, "lion": 1, "sgd": 1 if optim.momentum else 0}[optim.name]
    mixed = dtype in ("bf16", "fp16", "fp8")  # fp8: bf16 weights, FP8 only inside the matmuls
    param_bytes, grad_bytes = (2, 2) if mixed else (4, 4)
    optimizer_bytes = 4 * moments + (4 if mixed else 0)
    shard = [1, 1, 1]
    for part in range(zero):
        shard[2 - part] = dp_shard  # optimizer first, then grads, then params
    return ModelStates(
        params=params * param_bytes / shard[0],
        grads=params * grad_bytes / shard[1],
        optimizer=params * optimizer_bytes / shard[2],
    )


def activation_bytes(cfg: RecipeConfig, degrees: Degrees, microbatches: int) -> float:
    """Activation bytes on the busiest rank (Korthikanti et al. 2022, per layer, 16-bit).

    Per layer: s*b*h*(34 + 5*a*s/h); with TP the attention and MLP parts split as
    10 + 24/t + 5as/(ht), with SP everything splits by t; selective recompute drops the
    5as/h term; full recompute keeps only the 2*s*b*h layer input. Times the first stage's
    layers and micro-batches in flight, plus one micro-batch of fp32 logits.
    """
    m, t = cfg.model, degrees.tp
    s, b, h, a = cfg.train.seq_len // degrees.cp, cfg.train.micro_batch, m.dim, m.n_heads
    attention = 5 * a * s / h if cfg.recompute.policy != "selective" else 0.0
    if cfg.parallel.sp:
        per_layer = s * b * h * (34 + attention) / t
    else:
        per_layer = s * b * h * (10 + (24 + attention) / t)
    layer_input = 2 * s * b * h / (t if cfg.parallel.sp else 1)
    layers = m.n_layers // degrees.pp
    kept = recomputed_layers(layers, cfg.recompute.every) if cfg.recompute.policy == "full" else 0
    stage = kept * layer_input + (layers - kept) * per_layer
    scale = 2 if cfg.precision.dtype == "fp32" else 1
    logits = s * b * m.vocab_size * 4 / t
    flight = in_flight(cfg.parallel.pp_schedule, degrees.pp, microbatches, cfg.parallel.vpp)
    return stage * scale * flight + logits


def in_flight(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule in (*V_SCHEDULES, "2bw"):
        return rank_in_flight(schedule, pp, microbatches, vpp, 0)
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "interleaved_1f1b":
        return pp + (pp - 1) / vpp
    return float(min(microbatches, pp))


def _assumptions(cfg: RecipeConfig) -> list[str]:
    one = model_states(1, cfg.precision.dtype, cfg.optim, 0, 1)
    master = "fp32 master weights and " if cfg.precision.dtype != "fp32" else ""
    notes = [
        f"step time: model FLOPs at {MFU_ASSUMPTION:.0%} MFU of the dense "
        f"{peak_dtype(cfg.precision)} peak",
        f"model states: {one.params:g} B params + {one.grads:g} B grads + {one.optimizer:g} B "
        f"of {master}{cfg.optim.name} states per parameter (ZeRO paper bookkeeping), "
        "sharded over tp and pp always and over dp_shard by the ZeRO stage",
        "activations: Korthikanti et al. 2022 per-layer formula (16-bit, doubled for fp32) on the "
        "first stage, plus one micro-batch of fp32 logits; no allocator overhead or buffers",
    ]
    if cfg.parallel.tp > 1:
        notes.append(
            "TP communication: bytes sent per rank on a ring; recompute repeats the forward "
            "collectives of recomputed layers, not counted"
        )
    p = cfg.parallel
    if p.pp > 1 and p.pp_schedule == "zero_bubble":
        notes.append("bubble: zero_bubble reported at the 1F1B value, an upper bound")
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES:
        notes.append(
            f"bubble and in-flight: {p.pp_schedule}'s own op order (torch's), simulated with "
            "F = B = W; rank 0 holds the first and the last stage"
        )
    if p.pp > 1 and p.pp_schedule == "2bw":
        notes.append(
            f"2bw: the pipeline fills once per {segment_steps(cfg)} steps (a checkpoint drains "
            "it); each step's gradient is applied one step late; two weight versions and "
            "their gradients per stage in memory"
        )
    if p.cp > 1:
        notes.append(
            f"context parallelism: activations of s/cp = {cfg.train.seq_len // p.cp} tokens "
            "per rank; the K/V ring's traffic per layer is listed (hops overlap the attention)"
        )
    return notes


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain JSON-serialisable data (numbers in bytes, GiB and seconds)."""
    data = dataclasses.asdict(plan)
    data["degrees"]["dp"] = plan.degrees.dp
    data["model_states_by_zero"] = {
        f"zero{z}": {**dataclasses.asdict(states), "total": states.total}
        for z, states in plan.model_states_by_zero.items()
    }
    data["memory_gib"] = plan.memory_gib
    if plan.memory is not None:
        data["memory"]["total"] = plan.memory.total
    return data
