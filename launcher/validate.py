"""Every cross-field rule of a recipe, checked at once, reported as one error.

`validate` collects all problems before raising, so a user fixes a recipe in one pass; each
problem names the field path, the value, why it is wrong and a concrete fix.
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from launcher import hardware
from launcher.layout import (
    divisors,
    grad_accum_steps,
    nearby_multiples,
    or_list,
    resolve_degrees,
    world_size,
)
from launcher.moe import moe_problems
from launcher.precision import precision_problems
from launcher.schema import RecipeConfig

SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# The time formats sbatch --time accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+)$")
_SLURM_UNLIMITED = ("UNLIMITED", "INFINITE")


@dataclass
class Problem:
    """One thing wrong with a recipe: where, what, why, and how to fix it."""

    field: str
    value: Any
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}={_show(self.value)}: {self.reason}; {self.fix}"


class RecipeError(ValueError):
    """A recipe that cannot be planned or run; `problems` holds every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def _show(value: Any) -> str:
    """A value as it would be written in a Hydra override."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (not value or re.search(r"[\s'\"=,]", value)):
        return repr(value)
    return str(value)


class _Checks:
    """Collects problems; the helpers keep each rule to a line or two."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, field: str, value: Any, reason: str, fix: str) -> None:
        self.problems.append(Problem(field, value, reason, fix))

    def choice(self, field: str, value: str, allowed: tuple[str, ...]) -> bool:
        if value in allowed:
            return True
        self.add(field, value, f"unknown value {value!r}", f"use {or_list(list(allowed))}")
        return False

    def at_least(self, field: str, value: float, minimum: float) -> bool:
        if value >= minimum:
            return True
        self.add(field, value, f"must be >= {minimum}", f"use a value >= {minimum}")
        return False

    def positive(self, field: str, value: float) -> bool:
        if value > 0:
            return True
        self.add(field, value, "must be > 0", "use a positive value")
        return False


def validate(cfg: RecipeConfig, for_launch: bool = False, check_memory: bool = False) -> None:
    """Raise RecipeError listing every problem of `cfg`; return None if there is none.

    With `for_launch`, layouts this version's trainer cannot execute are problems too; with
    `check_memory`, a predicted peak memory per rank above the device's.
    """
    c = _Checks()
    c.choice("action", cfg.action, ("run", "plan", "script", "suggest"))
    if not SAFE_NAME.match(cfg.name):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.name).strip("_") or "run"
        c.add("name", cfg.name, "may hold only letters, digits, '_', '.' and '-'", f"use {safe}")
    model_ok = _check_model(c, cfg)
    train_ok = _check_train(c, cfg)
    cluster_ok = _check_cluster(c, cfg)
    _check_parallel(c, cfg, model_ok, train_ok, cluster_ok)
    _check_precision(c, cfg)
    for problem in moe_problems(cfg, for_launch):
        c.add(*problem)
    _check_optim(c, cfg, train_ok)
    c.choice("recompute.policy", cfg.recompute.policy, ("none", "full", "selective"))
    c.at_least("recompute.every", cfg.recompute.every, 1)
    c.at_least("logging.log_every", cfg.logging.log_every, 1)
    c.choice("logging.wandb", cfg.logging.wandb, ("auto", "online", "offline", "disabled"))
    c.choice("plan.format", cfg.plan.format, ("table", "json"))
    c.at_least("suggest.top", cfg.suggest.top, 1)
    c.choice("data.format", cfg.data.format, ("auto", "text", "jsonl", "parquet"))
    c.at_least("data.max_bytes", cfg.data.max_bytes, 0)
    c.at_least("hardware.peak_tflops", cfg.hardware.peak_tflops, 0)
    if for_launch and cfg.cluster.backend == "local":
        _check_local_data(c, cfg)
    _check_checkpoint(c, cfg)
    _check_speed(c, cfg)
    if for_launch:
        c.problems.extend(check_runnable(cfg))
    if check_memory and not c.problems:
        _check_memory(c, cfg)
    if c.problems:
        raise RecipeError(c.problems)


def _check_memory(c: _Checks, cfg: RecipeConfig) -> None:
    from launcher.fit import describe, device_memory_gib, fitting_changes, predict

    limit = device_memory_gib(cfg)
    breakdown = predict(cfg)
    if limit and breakdown.total_gib > limit:
        fixes = fitting_changes(cfg, limit)
        c.add(
            "parallel",
            f"tp={cfg.parallel.tp},pp={cfg.parallel.pp},zero={cfg.parallel.zero}",
            f"predicted peak {breakdown.total_gib:.1f} GiB per rank exceeds the {limit:g} GiB "
            f"of {cfg.cluster.gpu_type} ({describe(breakdown)})",
            "try " + or_list(fixes)
            if fixes
            else "raise ZeRO, tp or pp, recompute, or lower "
            "train.micro_batch (no single change fits)",
        )


def check_runnable(cfg: RecipeConfig) -> list[Problem]:
    """Layouts the trainer of this version cannot execute yet (they can still be planned)."""
    p = cfg.parallel
    replicas = world_size(cfg) > p.tp * p.pp
    unsupported = [
        (
            "parallel.zero",
            p.zero,
            p.tp > 1 and p.zero < 2 and replicas,
            "tensor parallelism with DDP or ZeRO-1 data parallelism",
            "parallel.zero=2 or 3 (FSDP2 composes with TP)",
        ),
        (
            "parallel.zero",
            p.zero,
            # DDP's reducer asserts on the second step when a pipeline schedule drives it.
            p.pp > 1 and p.zero < 2 and replicas,
            "pipeline parallelism with DDP or ZeRO-1 data parallelism",
            "parallel.zero=2 or 3 (FSDP2 composes with PP)",
        ),
        (
            "parallel.zero",
            p.zero,
            p.ep > 1 and p.zero == 1,
            "expert parallelism with ZeRO-1",
            "parallel.zero=0, 2 or 3",
        ),
    ]
    return [
        Problem(
            field,
            value,
            f"{what} is not implemented in the trainer yet; this layout can only be planned",
            f"inspect it with action=plan, or set {fix} to run",
        )
        for field, value, bad, what, fix in unsupported
        if bad
    ]


def _check_model(c: _Checks, cfg: RecipeConfig) -> bool:
    """Model shape rules; True when the shape is sound enough for the layout rules."""
    m = cfg.model
    c.choice("model.name", m.name, ("llama",))
    positive_ints = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len")
    ok = all([c.at_least(f"model.{f}", getattr(m, f), 1) for f in positive_ints])
    ok = c.at_least("model.n_kv_heads", m.n_kv_heads, 0) and ok
    for f in ("rope_theta", "norm_eps", "init_std"):
        c.positive(f"model.{f}", getattr(m, f))
    if not ok:
        return False
    if m.dim % m.n_heads:
        c.add(
            "model.dim",
            m.dim,
            f"not divisible by model.n_heads={m.n_heads} (heads need equal widths)",
            f"use a multiple of {m.n_heads}, e.g. {or_list(nearby_multiples(m.dim, m.n_heads))}",
        )
        ok = False
    if m.n_heads % m.kv_heads:
        c.add(
            "model.n_kv_heads",
            m.n_kv_heads,
            f"{m.n_heads} query heads cannot be grouped over {m.kv_heads} key/value heads",
            f"use a divisor of {m.n_heads}: {or_list(divisors(m.n_heads))}",
        )
        ok = False
    return ok


def _check_train(c: _Checks, cfg: RecipeConfig) -> bool:
    t = cfg.train
    ok = all(
        [c.at_least(f"train.{f}", getattr(t, f), 1) for f in ("steps", "seq_len", "micro_batch")]
        + [c.at_least("train.global_batch", t.global_batch, 1)]
    )
    if t.seq_len > cfg.model.max_seq_len:
        c.add(
            "train.seq_len",
            t.seq_len,
            f"longer than model.max_seq_len={cfg.model.max_seq_len}",
            f"use train.seq_len <= {cfg.model.max_seq_len} or raise model.max_seq_len",
        )
    return ok


def _check_cluster(c: _Checks, cfg: RecipeConfig) -> bool:
    k = cfg.cluster
    c.choice("cluster.backend", k.backend, ("local", "slurm"))
    c.choice("cluster.device", k.device, ("cuda", "cpu"))
    c.choice("cluster.gpu_type", k.gpu_type, tuple(hardware.known_gpus()))
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


def _check_parallel(
    c: _Checks, cfg: RecipeConfig, model_ok: bool, train_ok: bool, cluster_ok: bool
) -> None:
    p = cfg.parallel
    degrees_ok = all(
        [
            c.at_least(f"parallel.{f}", getattr(p, f), 1)
            for f in ("tp", "pp", "vpp", "dp_replicate", "ep")
        ]
    )
    if p.dp_shard < 1 and p.dp_shard != -1:
        c.add("parallel.dp_shard", p.dp_shard, "must be >= 1, or -1 to fill the world", "use -1")
        degrees_ok = False
    schedule_ok = c.choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
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
    if p.vpp > 1 and (p.pp == 1 or p.pp_schedule not in ("interleaved_1f1b", "zero_bubble")):
        c.add(
            "parallel.vpp",
            p.vpp,
            f"virtual stages need pp > 1 and an interleaved schedule (pp={p.pp}, {p.pp_schedule})",
            "set parallel.pp_schedule=interleaved_1f1b or zero_bubble with pp > 1, or vpp=1",
        )
    if p.pp > 1 and cfg.model.tie_embeddings:
        c.add(
            "model.tie_embeddings",
            True,
            "a tied LM head would sit on the last pipeline stage and its embedding on the first",
            "set model.tie_embeddings=false, or parallel.pp=1",
        )
    if not degrees_ok:
        return
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
    if train_ok and p.sp and p.tp > 1 and cfg.train.seq_len % p.tp:
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
        c.problems.extend(error.problems)
        return
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
        c.problems.extend(error.problems)
        return
    if p.pp > 1 and schedule_ok and p.pp_microbatches >= 0:
        micro = p.pp_microbatches or accum
        per_pass = cfg.train.micro_batch * degrees.dp
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
        elif p.vpp > 1 and micro % p.pp:
            c.add(
                "parallel.pp_microbatches",
                p.pp_microbatches,
                f"interleaving needs a multiple of pp={p.pp}; {micro} micro-batches{source} is not",
                f"use {or_list(nearby_multiples(micro, p.pp))}",
            )
        elif p.pp_microbatches and (cfg.train.micro_batch * accum) % micro:
            c.add(
                "parallel.pp_microbatches",
                p.pp_microbatches,
                f"each dp rank's {cfg.train.micro_batch * accum} sequences per step "
                f"(micro_batch*accumulation) do not split into {micro} equal micro-batches",
                f"use a divisor of {cfg.train.micro_batch * accum} that is >= {p.pp}, or 0",
            )


def _check_model_split(c: _Checks, cfg: RecipeConfig, max_tp: int | None) -> None:
    """Heads over tp and layers over pipeline stages; the model's shape is known to be sound."""
    p, m = cfg.parallel, cfg.model
    if m.n_heads % p.tp or m.kv_heads % p.tp:
        heads, what = (
            (m.n_heads, "attention heads") if m.n_heads % p.tp else (m.kv_heads, "key/value heads")
        )
        options = [
            d for d in divisors(math.gcd(m.n_heads, m.kv_heads)) if max_tp is None or d <= max_tp
        ]
        c.add(
            "parallel.tp",
            p.tp,
            f"{heads} {what} are not divisible by {p.tp}",
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
            + ", or list each stage's layers in parallel.pp_layers",
        )


def _check_pp_layers(c: _Checks, cfg: RecipeConfig) -> None:
    """An explicit split: one positive count per stage, summing to the model's layers."""
    p, n_layers = cfg.parallel, cfg.model.n_layers
    stages = p.pp * p.vpp
    if len(p.pp_layers) != stages or min(p.pp_layers) < 1 or sum(p.pp_layers) != n_layers:
        c.add(
            "parallel.pp_layers",
            p.pp_layers,
            f"needs pp*vpp = {stages} positive layer counts summing to model.n_layers={n_layers}",
            f"e.g. {_even_split(n_layers, stages)}, or [] for an even split",
        )


def _even_split(n_layers: int, stages: int) -> list[int]:
    """The most even split of n_layers over stages, the remainder on the middle stages."""
    counts = [n_layers // stages] * stages
    for i in range(n_layers % stages):
        counts[(stages - n_layers % stages) // 2 + i] += 1
    return counts


def _check_precision(c: _Checks, cfg: RecipeConfig) -> None:
    for field, value, reason, fix in precision_problems(cfg):
        c.add(field, value, reason, fix)


def _check_optim(c: _Checks, cfg: RecipeConfig, train_ok: bool) -> None:
    o, s, steps = cfg.optim, cfg.schedule, cfg.train.steps
    c.choice("optim.name", o.name, ("adamw", "lion", "sgd"))
    for f in ("lr", "min_lr", "weight_decay", "grad_clip"):
        c.at_least(f"optim.{f}", getattr(o, f), 0)
    if o.min_lr > o.lr >= 0:
        c.add(
            "optim.min_lr",
            o.min_lr,
            f"above the peak optim.lr={o.lr}",
            f"use optim.min_lr <= {o.lr}",
        )
    c.positive("optim.eps", o.eps)
    if not 0 <= o.momentum < 1:
        c.add("optim.momentum", o.momentum, "must lie in [0, 1)", "use 0.9, or 0 for plain SGD")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        c.add("optim.betas", o.betas, "need two values in [0, 1)", "use [0.9, 0.95]")
    scaling = c.choice("optim.lr_scaling", o.lr_scaling, ("none", "linear", "sqrt"))
    if scaling and o.lr_scaling != "none" and o.base_batch <= 0:
        c.add(
            "optim.base_batch",
            o.base_batch,
            f"lr_scaling={o.lr_scaling} scales relative to the batch lr was tuned for",
            f"set optim.base_batch to that global batch (e.g. {cfg.train.global_batch})",
        )
    c.choice("schedule.name", s.name, ("cosine", "linear", "constant", "wsd"))
    warm_ok = c.at_least("schedule.warmup_steps", s.warmup_steps, 0)
    decay_ok = c.at_least("schedule.decay_steps", s.decay_steps, 0)
    if not (train_ok and warm_ok and decay_ok):
        return
    if s.warmup_steps > steps:
        c.add(
            "schedule.warmup_steps",
            s.warmup_steps,
            f"longer than train.steps={steps}",
            f"use at most {steps}",
        )
    elif s.warmup_steps + s.decay_steps > steps:
        c.add(
            "schedule.decay_steps",
            s.decay_steps,
            f"warmup_steps + decay_steps = {s.warmup_steps + s.decay_steps} > train.steps={steps}",
            f"use at most {steps - s.warmup_steps}, or 0 to decay until the end",
        )


def _check_local_data(c: _Checks, cfg: RecipeConfig) -> None:
    """Local corpus files and tokenizer paths exist (checked on this machine, so only for a
    local launch: a SLURM login node need not see the compute nodes' file systems)."""
    d = cfg.data
    if d.source != "stdlib" and not d.source.startswith("hf:"):
        source = os.path.expanduser(d.source)
        if not (os.path.exists(source) or glob.glob(source, recursive=True)):
            c.add(
                "data.source",
                d.source,
                "no such file or directory, and no glob match",
                "give a local file, directory or glob of text/JSONL/Parquet, stdlib or hf:NAME",
            )
    if d.tokenizer != "train" and not os.path.exists(os.path.expanduser(d.tokenizer)):
        c.add(
            "data.tokenizer",
            d.tokenizer,
            "no such tokenizer.json or tokenizer directory",
            "give a tokenizer.json path or a Hugging Face tokenizer directory, or `train`",
        )


def _check_checkpoint(c: _Checks, cfg: RecipeConfig) -> None:
    """Checkpoint cadence and the fault limits."""
    c.at_least("checkpoint.every", cfg.checkpoint.every, 0)
    c.at_least("checkpoint.keep", cfg.checkpoint.keep, 1)
    c.choice("checkpoint.async_mode", cfg.checkpoint.async_mode, ("none", "thread", "process"))
    c.at_least("cluster.max_restarts", cfg.cluster.max_restarts, 0)
    c.at_least("faults.max_bad_steps", cfg.faults.max_bad_steps, 1)
    c.positive("faults.collective_timeout_s", cfg.faults.collective_timeout_s)
    c.positive("faults.straggler_lag", cfg.faults.straggler_lag)


def _check_speed(c: _Checks, cfg: RecipeConfig) -> None:
    """Compile, overlap and prefetch settings."""
    k = cfg.compile
    c.choice("compile.backend", k.backend, ("inductor", "aot_eager", "eager"))
    if k.enabled and not (k.blocks or k.loss):
        c.add(
            "compile.enabled",
            k.enabled,
            "compile.blocks and compile.loss are both false, so nothing would be compiled",
            "set compile.blocks=true and/or compile.loss=true, or compile.enabled=false",
        )
    c.choice("precision.reduce_dtype", cfg.precision.reduce_dtype, ("fp32", "bf16"))
    c.at_least("parallel.fsdp_prefetch", cfg.parallel.fsdp_prefetch, 0)
    c.positive("parallel.ddp_bucket_mb", cfg.parallel.ddp_bucket_mb)
    c.at_least("data.prefetch", cfg.data.prefetch, 0)
