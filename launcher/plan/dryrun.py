"""action=dryrun: one rank of the job through the trainer's real build and one real step,
under fake collectives and fake tensors (`python -m pretrain.trainer.dryrun`, a child process: the
launcher imports no torch), set beside the plan's own figures.

The plan's peak counts an allowance the dry run cannot see (CUDA context, NCCL, allocator
fragmentation: `MemoryBreakdown.framework`), so the measured peak is compared with the plan's
peak without it.

A rank's step is dry-run on a few of its micro-batches (`measured_recipe`), as the plan is
computed for the same count: each micro-batch of a step costs the dry run seconds, and the
step's peak and its per-micro-batch traffic are reached by then. The full step's traffic is
the cost model's at the recipe's count.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pretrain
from pretrain.core.hardware import GIB
from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.plan.comm.traffic import KINDS, step_traffic
from pretrain.launcher.plan.memory import memory_breakdown
from pretrain.launcher.plan.plan import Plan, plan_to_dict

INSTALL_ROOT = Path(pretrain.__file__).resolve().parent.parent
"""The directory holding the `pretrain` package this module was imported from (a checkout's
top level, or site-packages)."""
MIB = 2**20
"""A collective kind under this many bytes in a step holds only scalars: not compared."""
TIMEOUT_S = 900.0
"""A dry run of the largest layouts takes minutes; one that takes longer is a hang."""


class DryRunError(RuntimeError):
    """The dry run did not complete: the layout failed to build or step on `rank`."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"the dry run of rank {rank} failed: {reason}")
        self.rank, self.reason = rank, reason


@dataclass(frozen=True)
class Comparison:
    """One figure of the plan beside the dry run's."""

    name: str
    plan_bytes: float
    measured_bytes: float

    @property
    def ratio(self) -> float | None:
        """plan / measured; None where nothing was measured."""
        return self.plan_bytes / self.measured_bytes if self.measured_bytes else None


def fullest_rank(cfg: RecipeConfig) -> int:
    """The global rank of the pipeline stage the memory model says peaks highest (rank 0
    without a pipeline): the first rank of that stage, pp being the outermost mesh dim."""
    degrees = resolve_degrees(cfg)
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    totals = [memory_breakdown(cfg, degrees, micro, r).total for r in range(degrees.pp)]
    return totals.index(max(totals)) * (degrees.world // degrees.pp)


def rank_plan(cfg: RecipeConfig, plan: Plan, rank: int) -> Plan:
    """`plan` with the memory of `rank`'s pipeline stage in place of the fullest stage's."""
    degrees = resolve_degrees(cfg)
    pp_rank = rank // (degrees.world // degrees.pp)
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    return replace(plan, memory=memory_breakdown(cfg, degrees, micro, pp_rank))


def measured_recipe(cfg: RecipeConfig) -> RecipeConfig:
    """`cfg` with its global batch cut to the micro-batches per rank a dry run runs: two
    (the step's peak is reached by the second: every later one frees what it held, as the
    first did, and only the first and the last differ in their data-parallel traffic); a
    pipeline one per stage, at least, which puts on every stage as many in flight as the
    full step (GPipe, which holds every micro-batch in flight, runs them all). `cfg` itself
    where it has no more."""
    degrees = resolve_degrees(cfg)
    p = cfg.parallel
    traits = SCHEDULES[p.pp_schedule]
    if degrees.pp > 1 and traits.warmup_hops is None:  # every forward before a backward
        return cfg
    stages = degrees.pp * traits.chunks(p.vpp) if degrees.pp > 1 else 1
    micro = max(2, stages)
    full = p.pp_microbatches or grad_accum_steps(cfg)
    if full <= micro:
        return cfg
    cut = copy.deepcopy(cfg)
    cut.train.global_batch = micro * cfg.train.micro_batch * degrees.dp
    cut.parallel.pp_microbatches = 0
    return cut


def rank_traffic(cfg: RecipeConfig, rank: int) -> dict[str, float]:
    """The cost model's bytes per collective kind for `rank`'s step
    (`pretrain.launcher.plan.comm.traffic`)."""
    degrees = resolve_degrees(cfg)
    pp_rank = rank // (degrees.world // degrees.pp)
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    return step_traffic(cfg, degrees, micro, pp_rank).by_kind


def chosen_rank(cfg: RecipeConfig) -> int:
    """`dryrun.rank`, or the fullest rank when it is -1."""
    return cfg.dryrun.rank if cfg.dryrun.rank >= 0 else fullest_rank(cfg)


def run_dry_run(cfg: RecipeConfig, rank: int) -> dict:
    """Dry-run `rank` of `cfg` in a child process; its JSON result (DryRunError if it fails)."""
    degrees = resolve_degrees(cfg)
    if not 0 <= rank < degrees.world:
        raise DryRunError(rank, f"dryrun.rank={rank}: the job has ranks 0 to {degrees.world - 1}")
    try:
        # Started in the directory this launcher was imported from: the trainer comes from
        # the same install (or checkout), never from the user's cwd.
        done = subprocess.run(
            [sys.executable, "-m", "pretrain.trainer.dryrun", str(rank)], cwd=INSTALL_ROOT,
            input=dump_config(cfg), capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise DryRunError(rank, f"no result after {TIMEOUT_S:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if done.returncode != 0 or "error" in result or not result:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise DryRunError(rank, result.get("error") or tail[0])
    return result


def comparisons(plan: Plan, result: dict) -> list[Comparison]:
    """The plan's memory per category and peak beside what the dry run measured (the plan's
    peak without its framework allowance).

    The tracker files FSDP's unsharded weights as parameters and the gradients it holds
    between micro-batches as temporaries, where the plan counts transients and gradients:
    so past the states and the activations, the rest of the peak (gradients, weight copies,
    temporaries) is compared as one."""
    assert plan.memory is not None
    m, built, after, peak = plan.memory, result["built"], result["after_step"], result["peak"]
    params = built.get("Parameter", 0) + built.get("Buffer", 0)
    activations = peak.get("Activation", 0)
    states = after.get("Optstate", 0)
    peak_bytes = m.total - m.framework
    return [
        Comparison("parameters", m.params, params),
        Comparison("optimizer states", m.optimizer_states, states),
        Comparison("activations at peak", m.activations + m.logits, activations),
        Comparison(
            "grads, weight copies, temporaries",
            peak_bytes - m.params - m.optimizer_states - m.activations - m.logits,
            result["steady_peak"] - params - states - activations,
        ),
        Comparison("peak of later steps", peak_bytes, result["steady_peak"]),
    ]


def traffic_comparisons(cfg: RecipeConfig, result: dict) -> list[Comparison]:
    """The cost model's bytes per collective kind beside those the dry run counted, for
    every kind either has."""
    planned, measured = rank_traffic(cfg, result["rank"]), result["collectives"]
    kinds = [k for k in KINDS if k in planned or k in measured]
    kinds += sorted(set(measured) - set(kinds))
    return [Comparison(k, planned.get(k, 0.0), measured.get(k, 0)) for k in kinds]


def fits(plan: Plan, result: dict) -> str | None:
    """Why the dry run's peak does not fit the device (None when it fits or the device's
    memory is unknown): the measured peak plus the plan's framework allowance."""
    assert plan.memory is not None
    if not plan.gpu_memory_gib:
        return None
    need = (result["steady_peak"] + plan.memory.framework) / GIB
    if need <= plan.gpu_memory_gib:
        return None
    return (
        f"rank {result['rank']} peaks at {need:.1f} GiB (measured {result['peak_gib']:.1f} GiB "
        f"+ the plan's {plan.memory.framework / GIB:.1f} GiB allowance), more than the "
        f"{plan.gpu_memory_gib:.0f} GiB of a {plan.gpu_type}"
    )


def _comparison_dict(c: Comparison) -> dict:
    gib = {"plan_gib": c.plan_bytes / GIB, "dryrun_gib": c.measured_bytes / GIB}
    return {"name": c.name, **gib, "ratio": c.ratio}


def report_dict(cfg: RecipeConfig, plan: Plan, result: dict, step: RecipeConfig) -> dict:
    """The `dryrun` object of `plan.format=json`: the measurement and the plan's figures
    (`collectives` the bytes per kind measured, `plan_collectives` the cost model's, for the
    micro-batches of `cfg` run; `plan_step_collectives` the cost model's for the recipe's
    whole step, `step`)."""
    assert plan.memory is not None
    traffic = traffic_comparisons(cfg, result)
    return {
        **result,
        "step_micro_batches": step.parallel.pp_microbatches or grad_accum_steps(step),
        "plan_step_collectives": rank_traffic(step, result["rank"]),
        "plan_peak_gib": (plan.memory.total - plan.memory.framework) / GIB,
        "plan_peak_with_allowance_gib": plan.memory.total / GIB,
        "comparison": [_comparison_dict(c) for c in comparisons(plan, result)],
        "plan_collectives": {c.name: c.plan_bytes for c in traffic if c.plan_bytes},
        "collective_comparison": [_comparison_dict(c) for c in traffic],
        "fits": fits(plan, result) is None,
    }


def render(cfg: RecipeConfig, plan: Plan, result: dict, step: RecipeConfig) -> str:
    """The table: each figure of the plan, as measured under fake tensors, and their ratio
    (`cfg` the recipe run, `step` the recipe whose whole step it stands for)."""
    coords = ", ".join(f"{k} {v}" for k, v in result["coordinates"].items())
    full = step.parallel.pp_microbatches or grad_accum_steps(step)
    lines = [
        f"dry run of rank {result['rank']} of {result['world_size']} ({coords}) on fake "
        f"{result['device']} tensors: {result['micro_batches']} of the step's {full} "
        f"micro-batches, {result['seconds']:.0f} s; its peak in the {result['peak_at']}",
        f"  {'':<36}{'plan GiB':>10}{'dry run GiB':>13}{'ratio':>8}",
    ]
    for c in comparisons(plan, result):
        ratio = f"{c.ratio:.2f}" if c.ratio is not None else "-"
        lines.append(
            f"  {c.name:<36}{c.plan_bytes / GIB:>10.2f}{c.measured_bytes / GIB:>13.2f}{ratio:>8}"
        )
    lines.append("  collectives of the step (bytes this rank hands in), by kind:")
    for c in traffic_comparisons(cfg, result):
        # Under a MiB: the step's scalars (norms, agreements), which the plan leaves out.
        ratio = f"{c.ratio:.2f}" if c.ratio is not None and c.measured_bytes >= MIB else "-"
        lines.append(
            f"    {c.name:<34}{c.plan_bytes / GIB:>10.2f}{c.measured_bytes / GIB:>13.2f}{ratio:>8}"
        )
    lines.append("  measured, by group size:")
    for kind, sent in sorted(result["collectives_by_group"].items()):
        calls = result["collective_calls_by_group"].get(kind, 0)
        lines.append(f"    {kind:<28}{sent / GIB:>10.2f} GiB {calls:>8} calls")
    if step is not cfg:
        whole = ", ".join(
            f"{kind} {sent / GIB:.2f}" for kind, sent in rank_traffic(step, result["rank"]).items()
        )
        lines.append(f"  the whole step of {full} micro-batches, by the cost model (GiB): {whole}")
    return "\n".join(lines)


def dry_run_action(cfg: RecipeConfig, plan: Plan) -> str | None:
    """action=dryrun: print the comparison (one JSON object under plan.format=json); the
    problem to exit with when the dry run fails."""
    rank, run = chosen_rank(cfg), measured_recipe(cfg)
    try:
        result = run_dry_run(run, rank)
    except DryRunError as err:
        return f"Recipe '{cfg.name}': {err}"
    plan = rank_plan(run, plan, rank)
    if cfg.plan.format == "json":
        report = report_dict(run, plan, result, cfg)
        print(json.dumps({**plan_to_dict(plan), "dryrun": report}))
    else:
        print(render(run, plan, result, cfg))
        problem = fits(plan, result)
        print(f"  does not fit: {problem}" if problem else "  fits")
    return None


def refusal(cfg: RecipeConfig, plan: Plan) -> str | None:
    """plan.dryrun=true before a submission: why the job is refused (its dry run fails or
    does not fit), None to submit it."""
    rank, run = chosen_rank(cfg), measured_recipe(cfg)
    print(f"dry-running rank {rank} before submission (plan.dryrun=true) ...", flush=True)
    try:
        result = run_dry_run(run, rank)
    except DryRunError as err:
        return f"Recipe '{cfg.name}' is refused: {err}"
    plan = rank_plan(run, plan, rank)
    print(render(run, plan, result, cfg))
    problem = fits(plan, result)
    return f"Recipe '{cfg.name}' is refused: {problem}" if problem else None
