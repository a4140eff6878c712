"""Rules of the layout: degrees against the world, the model's split over tp and pipeline
stages, micro-batches against the schedule, SLURM's fields, and what the trainer can run."""

from __future__ import annotations

import re

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.problems import (
    Checks,
    Problem,
    RecipeError,
    divisors,
    nearby_multiples,
    or_list,
)
from pretrain.core.schedules import SCHEDULES, V
from pretrain.core.schema import PP_SCHEDULES, ParallelConfig, RecipeConfig
from pretrain.core.stages import balanced_split
from pretrain.launcher.validate.context import (
    check_context,
    check_mtp,
    check_schedule,
    runnable_problems,
)

MULTI_CHUNK = tuple(name for name, t in SCHEDULES.items() if t.multi_stage)
"""Schedules that run several chunks per rank."""

SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
"""Names that reach file paths and sbatch arguments unquoted."""
# The time formats sbatch --time accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+)$")
_SLURM_UNLIMITED = ("UNLIMITED", "INFINITE")


def check_runnable(cfg: RecipeConfig) -> list[Problem]:
    """Layouts the trainer cannot execute (they can still be planned), with the reason each
    fails."""
    return runnable_problems(cfg)


def check_cluster(c: Checks, cfg: RecipeConfig) -> bool:
    k = cfg.cluster
    c.at_least("cluster.gpu_memory_gib", k.gpu_memory_gib, 0)
    ok = c.at_least("cluster.nodes", k.nodes, 1) & c.at_least(
        "cluster.gpus_per_node", k.gpus_per_node, 1
    )
    if k.backend == "slurm":
        if not (_SLURM_TIME.match(k.time) or k.time.upper() in _SLURM_UNLIMITED):
            c.add(
                "cluster.time",
                k.time,
                "not a time limit sbatch accepts",
                'use [D-]HH:MM:SS (or MM, MM:SS, D-HH, D-HH:MM), e.g. "04:00:00" or "1-00:00:00"',
            )
        for f in ("partition", "account", "qos"):
            value = getattr(k, f)
            if value and not SAFE_NAME.match(value):
                c.add(
                    f"cluster.{f}",
                    value,
                    "may hold only letters, digits, '_', '.' and '-'",
                    f"use the {f} name exactly as `sinfo`/`sacctmgr` print it",
                )
    return ok


def check_parallel(
    c: Checks, cfg: RecipeConfig, model_ok: bool, train_ok: bool, cluster_ok: bool
) -> None:
    """The layout's rules; the `*_ok` flags say which other sections are sound enough for
    the rules that read them."""
    degrees_ok = _check_degrees(c, cfg)
    check_schedule(c, cfg)
    check_mtp(c, cfg)
    if not degrees_ok:
        return
    p = cfg.parallel
    max_tp = cfg.cluster.gpus_per_node if cluster_ok and not p.allow_tp_across_nodes else None
    if cluster_ok and max_tp is not None and p.tp > max_tp:
        c.add(
            "parallel.tp",
            p.tp,
            f"larger than one node's {max_tp} GPUs (TP traffic would leave the node)",
            f"use tp <= {max_tp}, or set parallel.allow_tp_across_nodes=true",
        )
    if model_ok:
        _check_model_split(c, cfg, max_tp)
    if train_ok:
        check_context(c, cfg)
    if train_ok and p.sp and p.tp > 1 and p.cp == 1 and cfg.train.seq_len % p.tp:
        c.add(
            "train.seq_len",
            cfg.train.seq_len,
            f"sequence parallelism splits the sequence over tp={p.tp} ranks evenly",
            f"use a multiple of {p.tp}, e.g. {or_list(nearby_multiples(cfg.train.seq_len, p.tp))}",
        )
    if not cluster_ok:
        return
    try:
        degrees = resolve_degrees(cfg)
    except RecipeError as error:
        c.extend(error.problems)
        return
    _check_offload(c, p)
    if degrees.dp % p.ep:
        c.add(
            "parallel.ep",
            p.ep,
            f"experts are spread over data-parallel ranks; dp={degrees.dp} is not divisible by it",
            f"use a divisor of {degrees.dp}: {or_list(divisors(degrees.dp))}",
        )
    if not train_ok:
        return
    try:
        accum = grad_accum_steps(cfg)
    except RecipeError as error:
        c.extend(error.problems)
        return
    if p.pp > 1 and p.pp_schedule in PP_SCHEDULES and p.pp_microbatches >= 0:
        _check_pipeline_microbatches(c, cfg, degrees.dp, accum)


def _check_offload(c: Checks, p: ParallelConfig) -> None:
    """Offload moves FSDP2's shards to the host: it needs ZeRO-2/3 (over any number of
    ranks: with dp=1 FSDP2 holds the whole model state on one rank, and moves it)."""
    if p.offload != "none" and p.zero < 2:
        c.add(
            "parallel.offload",
            p.offload,
            f"offloads the shards of ZeRO-2/3 (FSDP2), and parallel.zero={p.zero}",
            "set parallel.zero=3 (or 2), or parallel.offload=none",
        )


def _check_degrees(c: Checks, cfg: RecipeConfig) -> bool:
    """Each degree on its own and the combinations that need no world size; True when the
    degrees are sound enough for the rules that combine them."""
    p = cfg.parallel
    degrees_ok = all(
        [
            c.at_least(f"parallel.{f}", getattr(p, f), 1)
            for f in ("tp", "cp", "pp", "vpp", "dp_replicate", "ep", "etp")
        ]
    )
    if p.dp_shard < 1 and p.dp_shard != -1:
        c.add("parallel.dp_shard", p.dp_shard, "must be >= 1, or -1 to fill the world", "use -1")
        degrees_ok = False
    c.at_least("parallel.pp_microbatches", p.pp_microbatches, 0)
    if p.zero not in (0, 1, 2, 3):
        c.add("parallel.zero", p.zero, "not a ZeRO stage", "use 0 (DDP), 1, 2 or 3")
    elif p.dp_replicate > 1 and p.zero == 0:
        c.add(
            "parallel.dp_replicate",
            p.dp_replicate,
            "replicas of sharded groups (hybrid sharding) need ZeRO >= 1",
            "set parallel.zero to 1, 2 or 3, or dp_replicate=1 (ZeRO 0 replicates over dp_shard)",
        )
    if p.sp and p.tp == 1:
        c.add(
            "parallel.sp",
            p.sp,
            "sequence parallelism works inside tensor parallelism",
            "set tp > 1 or sp=false",
        )
    if p.vpp > 1 and (p.pp == 1 or p.pp_schedule not in MULTI_CHUNK):
        c.add(
            "parallel.vpp",
            p.vpp,
            f"virtual stages need pp > 1 and an interleaved schedule (pp={p.pp}, {p.pp_schedule})",
            f"set parallel.pp_schedule={or_list(MULTI_CHUNK)} with pp > 1, or vpp=1",
        )
    return degrees_ok


def _check_pipeline_microbatches(c: Checks, cfg: RecipeConfig, dp: int, accum: int) -> None:
    """The schedule's micro-batches fill the pipeline and split each dp rank's batch."""
    p, t = cfg.parallel, SCHEDULES[cfg.parallel.pp_schedule]
    micro = p.pp_microbatches or accum
    stages = p.pp * t.chunks(p.vpp)
    per_pass = cfg.train.micro_batch * dp
    source = "" if p.pp_microbatches else f" (0 takes the gradient-accumulation count {accum})"
    if micro < p.pp:
        c.add(
            "parallel.pp_microbatches",
            p.pp_microbatches,
            f"{micro} micro-batch(es){source} cannot fill {p.pp} pipeline stages",
            f"use parallel.pp_microbatches >= {p.pp}"
            if p.pp_microbatches
            else f"raise train.global_batch to {p.pp * per_pass} ({p.pp} micro-batches per "
            "dp rank), or set parallel.pp_microbatches",
        )
    elif t.fills_every_stage and micro < stages:
        c.add(
            "parallel.pp_microbatches",
            p.pp_microbatches,
            f"{t.title} needs at least as many micro-batches as stages "
            f"({t.chunks(p.vpp)}pp = {stages}); {micro}{source} is fewer",
            f"use parallel.pp_microbatches >= {stages}"
            if p.pp_microbatches
            else f"raise train.global_batch to {stages * per_pass}, or set "
            "parallel.pp_microbatches",
        )
    elif p.vpp > 1 and t.placement != V and micro % p.pp:
        c.add(
            "parallel.pp_microbatches",
            p.pp_microbatches,
            f"interleaving needs a multiple of pp={p.pp}; {micro} micro-batches{source} is not",
            f"use {or_list(nearby_multiples(micro, p.pp))}",
        )
    elif t.interleaved and micro % max(1, micro // p.pp):
        c.add(
            "parallel.pp_microbatches",
            p.pp_microbatches,
            f"{p.pp_schedule} runs the micro-batches in {micro // p.pp} equal rounds "
            f"(micro-batches // pp); {micro}{source} does not split into them",
            f"use a multiple of pp={p.pp}, e.g. {or_list(nearby_multiples(micro, p.pp))}",
        )
    elif p.pp_microbatches and (cfg.train.micro_batch * accum) % micro:
        c.add(
            "parallel.pp_microbatches",
            p.pp_microbatches,
            f"each dp rank's {cfg.train.micro_batch * accum} sequences per step "
            f"(micro_batch*accumulation) do not split into {micro} equal micro-batches",
            f"use a divisor of {cfg.train.micro_batch * accum} that is >= {p.pp}, or 0",
        )


def _check_model_split(c: Checks, cfg: RecipeConfig, max_tp: int | None) -> None:
    """Heads over tp and layers over pipeline stages; the model's shape is known to be sound."""
    p, m = cfg.parallel, cfg.model
    # Fewer key/value heads than tp are replicated (parallel/tensor.py) when tp is a
    # multiple of them: each rank's query heads then share one.
    kv_split = m.kv_heads % p.tp == 0 or (not m.is_mla and p.tp % m.kv_heads == 0)
    if m.n_heads % p.tp or not kv_split:
        heads, what = (
            (m.n_heads, "attention heads") if m.n_heads % p.tp else (m.kv_heads, "key/value heads")
        )
        options = [
            d
            for d in divisors(m.n_heads)
            if (m.kv_heads % d == 0 or (not m.is_mla and d % m.kv_heads == 0))
            and (max_tp is None or d <= max_tp)
        ]
        c.add(
            "parallel.tp",
            p.tp,
            f"{heads} {what} are not divisible by {p.tp}"
            + ("" if m.n_heads % p.tp else ", nor is tp a multiple of them (replicated heads)"),
            f"use {or_list(options)}",
        )
    stages = p.pp * p.vpp
    if p.pp_layers:
        _check_pp_layers(c, cfg)
    elif m.n_layers % stages:
        pps = divisors(m.n_layers // p.vpp) if m.n_layers % p.vpp == 0 else []
        pps = [d for d in pps if p.vpp == 1 or d > 1][:8]
        c.add(
            "parallel.pp",
            p.pp,
            f"{m.n_layers} layers are not divisible by pp*vpp = {p.pp}*{p.vpp} = {stages} "
            "(every stage holds the same whole layers)",
            (
                f"use pp in {or_list(pps)}" + (" or set vpp=1" if p.vpp > 1 else "")
                if pps
                else "set vpp=1"
            )
            + (
                f", or list each stage's layers, e.g. parallel.pp_layers="
                f"{_compact(balanced_split(m.n_layers, stages))}"
                if stages <= m.n_layers
                else f" (at most {m.n_layers} stages: one layer each)"
            ),
        )


def _check_pp_layers(c: Checks, cfg: RecipeConfig) -> None:
    """An explicit split: one positive count per stage, summing to the model's layers."""
    p, n_layers = cfg.parallel, cfg.model.n_layers
    stages = p.pp * p.vpp
    if len(p.pp_layers) != stages or min(p.pp_layers) < 1 or sum(p.pp_layers) != n_layers:
        c.add(
            "parallel.pp_layers",
            p.pp_layers,
            f"needs pp*vpp = {stages} positive layer counts summing to model.n_layers={n_layers}",
            f"e.g. {_compact(balanced_split(n_layers, stages))}, or [] for an even split"
            if stages <= n_layers
            else f"use pp*vpp <= {n_layers} (a stage holds at least one layer)",
        )


def _compact(counts: list[int]) -> str:
    """A layer split as a Hydra list override, without spaces: [7,8,8,7]."""
    return "[" + ",".join(map(str, counts)) + "]"
