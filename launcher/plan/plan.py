"""The plan: pure arithmetic on a valid recipe, before anything runs.

Layout and rank groups, parameter counts per rank, FLOPs per token (the same `models.flops`
functions the trainer's MFU uses), pipeline bubble, memory per rank
(`pretrain.launcher.plan.memory`) and
the step time and MFU of the cost model the layout search ranks by (`pretrain.launcher.plan.cost`).
Every assumption behind a number is listed in `Plan.assumptions`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pretrain.core import hardware
from pretrain.core.hardware import GIB
from pretrain.core.layout import (
    Degrees,
    expert_node_groups,
    grad_accum_steps,
    rank_groups,
    resolve_degrees,
)
from pretrain.core.optim_states import state_bytes, state_tensors
from pretrain.core.pipedream import segment_steps
from pretrain.core.precision import fp8_experts, fp8_placement, peak_dtype
from pretrain.core.recompute import recomputed_blocks
from pretrain.core.schedules import SCHEDULES, V, splits_backward
from pretrain.core.schema import OptimConfig, RecipeConfig
from pretrain.launcher.plan import cost
from pretrain.launcher.plan.calibrated import calibrated_device, calibration_note
from pretrain.launcher.plan.comm.cp import CPComm, cp_communication
from pretrain.launcher.plan.comm.ep import EPComm, ETPComm, ep_communication, etp_communication
from pretrain.launcher.plan.comm.tp import TPComm, tp_communication
from pretrain.launcher.plan.memory import (
    MemoryBreakdown,
    peak_breakdown,
    stage_params,
    textbook_activations,
    textbook_model_states,
)
from pretrain.launcher.plan.muon_work import MuonWork, muon_work
from pretrain.launcher.plan.phases import (
    MixturePhasePlan,
    PhasePlan,
    mixture_phases,
    ramp_phases,
)
from pretrain.launcher.plan.pipeline import schedule_sim
from pretrain.models.flops import count_params, flops_per_token

LONG_CONTEXT = 16384
"""Sequences from this length on are long: context parallelism is among the fixes the plan
and the layout search offer."""
GROUPS_SHOWN = 4
"""Rank groups kept per dim in a plan; the rest are counted."""


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
    """The cost model's step time (`pretrain.launcher.plan.cost`); None without a GPU peak and
    links."""
    tokens_per_s: float | None
    mfu: float | None = None
    """Model FLOPs utilisation at `step_time_s`."""
    step_cost: cost.StepCost | None = None
    """The step time's terms."""
    memory: MemoryBreakdown | None = None
    """Peak bytes per rank by category as this trainer allocates them (launcher/plan/memory.py)."""
    assumptions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tp_comm: TPComm | None = None
    """One layer's tensor-parallel collectives per step and rank (None without TP)."""
    pipeline: dict | None = None
    """The simulated schedule: chart, bubble, in-flight per stage (None without PP)."""
    cp_comm: CPComm | None = None
    """One layer's context-parallel ring exchanges per step and rank (None without CP)."""
    ep_comm: EPComm | None = None
    """One MoE layer's all-to-all per micro-batch and rank (None without EP)."""
    phases: list[PhasePlan] = field(default_factory=list)
    """Each phase of a batch-size ramp or sequence-length warm-up, planned (the figures
    above are the last and largest stage's); empty without a ramp."""
    mixture_phases: list[MixturePhasePlan] = field(default_factory=list)
    """Each phase of data.mixture_schedule: its first step and shares."""
    muon: MuonWork | None = None
    """Muon's Newton-Schulz work and traffic per step on the busiest rank (None without Muon)."""
    fp8: str = ""
    """What computes in FP8 (`pretrain.core.precision.fp8_placement`); empty unless fp8."""
    etp_comm: ETPComm | None = None
    """One MoE layer's expert-tensor-parallel all-reduces per micro-batch and rank (None
    without etp)."""

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
    stages = [sum(stage_params(cfg, r)[:2]) for r in range(degrees.pp)]
    first, last = stages[0], stages[-1]
    # Routed experts are split over ep and etp rather than tp (parallel/expert.py).
    experts = counts.experts // degrees.pp
    per_rank = math.ceil(
        (max(stages) - experts) / degrees.tp + experts / (degrees.ep * degrees.etp)
    )
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    fraction = len(recomputed_blocks(cfg.recompute, cfg.model.n_layers)) / cfg.model.n_layers
    on_gpu = cfg.cluster.device == "cuda"
    spec = hardware.gpu_spec(cfg.cluster.gpu_type if on_gpu else "cpu")
    peak = cfg.hardware.peak_tflops or spec.peak_tflops.get(peak_dtype(cfg.precision))
    tokens = cfg.train.global_batch * cfg.train.seq_len
    links = cost.recipe_links(cfg, spec.name)
    kernels = None
    calibrated = calibrated_device(cfg)
    if calibrated is not None:
        # Measured on this machine (action=calibrate): its rates, and on a CPU its peak.
        kernels, measured_links, calibration = calibrated
        links = cost.with_recipe_links(cfg, measured_links)
        peak = peak or kernels.peak["bf16"]
    step = cost.step_cost(cfg, degrees, micro, peak, links, kernels) if peak and links else None
    step_time = step.total if step else None
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
        flops_per_token_hardware=fpt.with_recompute(cfg.recompute.policy, fraction, degrees.tp > 1),
        tokens_per_step=tokens,
        grad_accum=accum,
        pp_microbatches=micro,
        bubble_fraction=schedule_sim.bubble_fraction(
            cfg.parallel.pp_schedule, degrees.pp, micro, cfg.parallel.vpp, segment_steps(cfg)
        ),
        zero=cfg.parallel.zero,
        model_states_by_zero={
            z: model_states(per_rank, cfg.precision.dtype, cfg.optim, z, degrees.dp_shard)
            for z in range(4)
        },
        activations=textbook_activations(cfg, degrees, micro),
        gpu_type=spec.name,
        gpu_memory_gib=memory,
        peak_tflops=peak,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time else None,
        mfu=cost.predicted_mfu(cfg, step_time, peak) if step_time and peak else None,
        step_cost=step,
    )
    plan.memory = peak_breakdown(cfg, degrees, micro)
    plan.assumptions = _assumptions(cfg)
    if step and peak and links:
        dtype = peak_dtype(cfg.precision)
        plan.assumptions += [
            "step time: " + line
            for line in cost.assumptions(spec.name, links, peak, dtype, kernels)
        ]
    if calibrated is not None:
        plan.assumptions.append(f"rates: {calibration_note(calibration)}")
    _add_terms(cfg, plan, degrees, micro)
    plan.warnings += _warnings(cfg, plan, spec.name)
    return plan


def _add_terms(cfg: RecipeConfig, plan: Plan, degrees: Degrees, micro: int) -> None:
    """Fill in `plan`'s per-parallelism traffic, Muon's work, what runs in FP8, the pipeline
    schedule's summary and the phases of a ramp or a mixture schedule."""
    plan.tp_comm = tp_communication(cfg, degrees)
    plan.cp_comm = cp_communication(cfg, degrees)
    plan.ep_comm = ep_communication(cfg, degrees)
    plan.muon = muon_work(cfg, degrees)
    plan.etp_comm = etp_communication(cfg, degrees)
    plan.fp8 = fp8_placement(cfg.precision, cfg.model.moe_experts > 0)
    if degrees.pp > 1:
        plan.pipeline = schedule_sim.summary(
            cfg.parallel.pp_schedule, degrees.pp, micro, cfg.parallel.vpp, segment_steps(cfg)
        )
    plan.phases = ramp_phases(cfg, degrees)
    plan.mixture_phases = mixture_phases(cfg)
    if plan.phases:
        plan.assumptions.append(
            "ramp: memory, step time and MFU are the last stage's (train.global_batch x "
            "seq_len, the largest); the Phases table plans each at its own batch and seq_len"
        )


def _warnings(cfg: RecipeConfig, plan: Plan, gpu: str) -> list[str]:
    """A context-parallel ring that leaves its node, a node limit an ep group inside one node
    makes moot, routed experts that stay bf16 under fp8, blocks that compile nothing under
    cp, recompute under a split-backward
    schedule (which the plan does not model), and a peak over the device's memory with the
    levers that lower it (for long sequences, in the order to pull them)."""
    found = []
    p = cfg.precision
    if p.dtype == "fp8" and cfg.model.moe_experts > 0 and not fp8_experts(p):
        why = (
            "this trainer swaps Transformer Engine's linear layers only"
            if p.fp8_backend == "te"
            else f"torchao has no FP8 grouped GEMM with {p.fp8_recipe} scaling"
        )
        found.append(
            f"precision.fp8_recipe={p.fp8_recipe}: the routed experts run in bf16 ({why}); "
            "torchao's rowwise, mxfp8 or blockwise scaling runs them in FP8"
        )
    if cfg.model.moe_node_limit and not cfg.model.moe_groups and expert_node_groups(cfg) == 1:
        found.append(
            f"model.moe_node_limit={cfg.model.moe_node_limit} is moot: the ep group "
            f"(parallel.ep={cfg.parallel.ep}) fits in one node of {cfg.cluster.gpus_per_node} "
            "ranks, so every token's experts are on one node already"
        )
    k = cfg.compile
    if cfg.parallel.cp > 1 and k.enabled and k.blocks and cfg.model.n_moe_layers:
        found.append(
            f"compile.blocks=true under parallel.cp={cfg.parallel.cp}: the blocks with routed "
            "experts run eagerly (the ring attention's point-to-point exchange and the "
            "experts' dispatch cannot be traced; dense blocks compile their feed-forward)"
        )
    if cost.reruns_compiled_backward(cfg):
        found.append(
            f"compile.blocks=true under parallel.pp_schedule={cfg.parallel.pp_schedule}: a "
            "compiled block's backward is one node, so the input-gradient pass and the weight "
            "pass each run all of it (two backwards per micro-batch, costed in this plan's "
            "compute); 1f1b or interleaved_1f1b compile without it, or compile.blocks=false"
        )
    split = splits_backward(cfg.parallel.pp, cfg.parallel.pp_schedule)
    if split and cfg.recompute.policy != "none":
        found.append(
            f"recompute.policy={cfg.recompute.policy} under parallel.pp_schedule="
            f"{cfg.parallel.pp_schedule}: the weight pass reads what the input-grad pass "
            "recomputed, and the dry run measures the last stage holding more than it does "
            "without recompute (2.9x at the test model's size), where this plan counts the "
            "saving; check the fullest ranks with action=dryrun"
        )
    if plan.cp_comm is not None and plan.cp_comm.crosses_nodes:
        found.append(
            f"the context-parallel ring spans tp*cp = {plan.cp_comm.ring_span} ranks, more than "
            f"a node's {cfg.cluster.gpus_per_node}: every hop crosses the inter-node link"
        )
    memory = plan.gpu_memory_gib
    assert plan.memory is not None
    if memory and max(plan.memory_gib, plan.memory.total_gib) > memory:
        peak = max(plan.memory_gib, plan.memory.total_gib)
        fixes = "raise parallel.zero, tp or pp, lower train.micro_batch, or recompute"
        if cfg.train.seq_len >= LONG_CONTEXT:
            fixes = (
                "for a long sequence pull recompute, then sp (with tp), then parallel.cp, then "
                "a smaller train.micro_batch; or raise parallel.zero, tp or pp"
            )
        found.append(
            f"estimated {peak:.1f} GiB per rank exceeds the {memory:g} GiB of {gpu}: {fixes}"
        )
    return found


def model_states(
    params: int, dtype: str, optim: OptimConfig, zero: int, dp_shard: int
) -> ModelStates:
    """The ZeRO paper's bytes of params, grads and optimizer states on one rank holding
    `params` parameters (`pretrain.launcher.plan.memory.textbook_model_states`), sharded over
    dp_shard;
    the moments take `optim.state_dtype`'s bytes (Muon: its one state of the weight
    matrices, which dominate)."""
    moments = state_tensors(optim)[0]
    states = textbook_model_states(
        params, optim.name, zero, dp_shard, dtype, moments, state_bytes(optim.state_dtype)
    )
    return ModelStates(*states)


def _assumptions(cfg: RecipeConfig) -> list[str]:
    one = model_states(1, cfg.precision.dtype, cfg.optim, 0, 1)
    master = "fp32 master weights and " if cfg.precision.dtype != "fp32" else ""
    notes = [
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
    p, t = cfg.parallel, SCHEDULES[cfg.parallel.pp_schedule]
    if p.pp > 1 and t.split_backward and not t.simulated:
        notes.append(
            f"bubble: {p.pp_schedule} reported at the interleaved 1F1B value, an upper bound "
            "(the simulated schedule below shows how much its weight gradients fill)"
        )
    if p.pp > 1 and t.placement == V:
        notes.append(
            f"bubble and in-flight: {p.pp_schedule}'s own op order (torch's), simulated with "
            "F = B = W; rank 0 holds the first and the last stage"
        )
    if p.pp > 1 and not t.flushes:
        notes.append(
            f"{p.pp_schedule}: the pipeline fills once per {segment_steps(cfg)} steps (a "
            "checkpoint drains it); each step's gradient is applied one step late; two weight "
            "versions and their gradients per stage in memory"
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
