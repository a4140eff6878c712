"""The plan of each phase of a batch-size ramp or sequence-length warm-up, and the shares of
each phase of a mixture schedule.

The plan's own figures (memory, step time, MFU) are those of the recipe's global batch and
seq_len, the last and largest stage; each phase is planned again as the recipe with its
global batch and seq_len: its accumulation, the cost model's step time, tokens/s and MFU,
and this trainer's peak memory per rank, which is never above the last stage's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from pretrain.core import hardware
from pretrain.core.data_order.mixture import Mixture
from pretrain.core.data_order.ramps import Ramp
from pretrain.core.layout import Degrees, grad_accum_steps
from pretrain.core.precision import peak_dtype
from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.sources import resolved_sources, source_label
from pretrain.launcher.plan import cost
from pretrain.launcher.plan.memory import peak_breakdown


@dataclass(frozen=True)
class PhasePlan:
    """One phase of the ramp, planned."""

    first_step: int
    """1-based, as the metrics count steps."""
    last_step: int
    tokens_before: int
    """Tokens trained before its first step."""
    global_batch: int
    seq_len: int
    grad_accum: int
    pp_microbatches: int
    tokens_per_step: int
    memory_gib: float
    """This trainer's peak memory per rank at the phase's batch and seq_len."""
    step_time_s: float | None
    tokens_per_s: float | None
    mfu: float | None


@dataclass(frozen=True)
class MixturePhasePlan:
    """One phase of the mixture schedule: where it starts and its shares there."""

    name: str
    first_step: int | None
    """1-based; None when train.steps ends before it."""
    from_tokens: int
    shares: dict[str, float]
    blend: bool


def stage_recipe(cfg: RecipeConfig, global_batch: int, seq_len: int) -> RecipeConfig:
    """`cfg` with one stage's global batch and seq_len, and no schedules."""
    stage = copy.deepcopy(cfg)
    stage.train.global_batch, stage.train.seq_len = global_batch, seq_len
    stage.train.batch_schedule, stage.train.seq_len_schedule = [], []
    stage.data.mixture_schedule = []
    return stage


def ramp_phases(cfg: RecipeConfig, degrees: Degrees) -> list[PhasePlan]:
    """Each phase of the ramp that train.steps reaches, planned (none without a ramp)."""
    ramp = Ramp(cfg.train)
    if not ramp.active:
        return []
    on_gpu = cfg.cluster.device == "cuda"
    spec = hardware.gpu_spec(cfg.cluster.gpu_type if on_gpu else "cpu")
    peak = cfg.hardware.peak_tflops or spec.peak_tflops.get(peak_dtype(cfg.precision))
    links = cost.recipe_links(cfg, spec.name)
    planned = []
    for phase in ramp.within(cfg.train.steps):
        assert phase.steps is not None
        stage = stage_recipe(cfg, phase.global_batch, phase.seq_len)
        accum = grad_accum_steps(stage)
        micro = stage.parallel.pp_microbatches or accum
        step = cost.step_cost(stage, degrees, micro, peak, links).total if peak and links else None
        planned.append(
            PhasePlan(
                first_step=phase.first_step + 1,
                last_step=phase.first_step + phase.steps,
                tokens_before=phase.tokens_before,
                global_batch=phase.global_batch,
                seq_len=phase.seq_len,
                grad_accum=accum,
                pp_microbatches=micro,
                tokens_per_step=phase.tokens_per_step,
                memory_gib=peak_breakdown(stage, degrees, micro).total_gib,
                step_time_s=step,
                tokens_per_s=phase.tokens_per_step / step if step else None,
                mfu=cost.predicted_mfu(stage, step, peak) if step and peak else None,
            )
        )
    return planned


def mixture_phases(cfg: RecipeConfig) -> list[MixturePhasePlan]:
    """Each phase of the mixture schedule, with its first step and shares (none without)."""
    phases = cfg.data.mixture_schedule
    if not phases:
        return []
    ramp = Ramp(cfg.train)
    labels = [source_label(s, i) for i, s in enumerate(resolved_sources(cfg.data))]
    mixture = Mixture([s.weight for s in cfg.data.sources], ramp, phases)
    planned = []
    for i, phase in enumerate(phases):
        step = ramp.first_step_at(phase.from_tokens)
        reached = step < cfg.train.steps
        shares = mixture.segments[i].shares
        planned.append(
            MixturePhasePlan(
                name=phase.name or f"phase {i}",
                first_step=step + 1 if reached else None,
                from_tokens=phase.from_tokens,
                shares={label: float(q) for label, q in zip(labels, shares, strict=True)},
                blend=phase.blend,
            )
        )
    return planned
