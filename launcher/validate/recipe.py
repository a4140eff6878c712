"""Every rule of a recipe, checked at once, reported as one error.

`validate` collects all problems before raising, so a user fixes a recipe in one pass; each
problem names the field path, the value, why it is wrong and a concrete fix. The rules of
the layout, precision and mixture-of-experts live in `rules_parallel`, `rules_precision`
and `rules_moe`; whether the recipe fits the device's memory is `memory_fit`'s question,
asked after this one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

from pretrain.core.calibration import LAYOUT_FIELDS, layout_variants
from pretrain.core.hf.export import export_refusal
from pretrain.core.layout import expert_node_groups
from pretrain.core.problems import (
    Checks,
    Problem,
    RecipeError,
    divisors,
    nearby_multiples,
    or_list,
)
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import STABILITY_ALERTS, RecipeConfig, choice_fields, field_value
from pretrain.launcher.validate.attention import check_attention
from pretrain.launcher.validate.bounds import check_bounds
from pretrain.launcher.validate.data import check_data
from pretrain.launcher.validate.env import check_env, check_local_device
from pretrain.launcher.validate.job import check_job
from pretrain.launcher.validate.job_limits import check_disk_room, check_signal_lead
from pretrain.launcher.validate.layout import (
    SAFE_NAME,
    check_cluster,
    check_parallel,
    check_runnable,
)
from pretrain.launcher.validate.logs import check_logging, check_stability
from pretrain.launcher.validate.moe import check_moe
from pretrain.launcher.validate.precision import check_precision
from pretrain.launcher.validate.rundir import check_run_dir
from pretrain.launcher.validate.schedules import check_schedules

MAX_SEED = 2**32 - 1
"""Seeds are 32-bit (numpy's limit)."""
MAX_STEPS = 10**9
MAX_GLOBAL_BATCH = 2**24


def _check_calibrate(c: Checks, cfg: RecipeConfig) -> None:
    """calibrate.steps is a count; every calibrate.layouts entry sets layout fields only."""
    c.at_least("calibrate.steps", cfg.calibrate.steps, 1)
    try:
        layout_variants(cfg)
    except ValueError as error:
        c.add(
            "calibrate.layouts",
            cfg.calibrate.layouts,
            str(error).split(": ", 1)[-1],
            "give each layout as space-separated key=value items of "
            f"{', '.join(LAYOUT_FIELDS)} fields, e.g. "
            "\"calibrate.layouts=['parallel.zero=3','parallel.tp=2 parallel.sp=true']\"",
        )


def validate(
    cfg: RecipeConfig, for_launch: bool = False, run_dir: bool = False, here: bool = False
) -> None:
    """Raise RecipeError listing every problem of `cfg`; return None if there is none.

    With `for_launch`, layouts this version's trainer cannot execute are problems too; with
    `run_dir`, `run.dir` must be a directory the run may be written to; with `here` (the
    job starts on this machine), its devices must exist here.
    """
    c = Checks()
    for path, allowed in choice_fields():
        c.choice(path, field_value(cfg, path), allowed)
    if not SAFE_NAME.match(cfg.name):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.name).strip("_") or "run"
        c.add("name", cfg.name, "may hold only letters, digits, '_', '.' and '-'", f"use {safe}")
    if not 0 <= cfg.seed <= MAX_SEED:
        c.add("seed", cfg.seed, f"seeds are 32-bit: 0 to {MAX_SEED:,}", "use e.g. 1234")
    # A count over its bound would be walked or allocated by the rules below: they skip it.
    bounded = check_bounds(c, cfg)
    model_ok = _check_model(c, cfg) and bounded
    check_attention(c, cfg, model_ok)
    batch_ok = _check_train(c, cfg) and bounded
    cluster_ok = check_cluster(c, cfg) and bounded
    check_env(c, cfg)
    check_job(c, cfg)
    check_logging(c, cfg)
    check_stability(c, cfg)
    check_parallel(c, cfg, model_ok, batch_ok, cluster_ok)
    check_precision(c, cfg)
    check_moe(c, cfg, for_launch)
    _check_optim(c, cfg)
    c.at_least("recompute.every", cfg.recompute.every, 1)
    c.at_least("logging.log_every", cfg.logging.log_every, 1)
    c.at_least("suggest.top", cfg.suggest.top, 1)
    _check_calibrate(c, cfg)
    c.at_least("hardware.peak_tflops", cfg.hardware.peak_tflops, 0)
    for link in ("intra_node_gbs", "inter_node_gbs"):
        c.at_least(f"hardware.{link}", getattr(cfg.hardware, link), 0)
    for latency in ("intra_node_latency_us", "inter_node_latency_us"):
        c.at_least(f"hardware.{latency}", getattr(cfg.hardware, latency), 0)
    check_data(c, cfg, for_launch)
    check_schedules(c, cfg, _problems_of if batch_ok and model_ok and cluster_ok else None)
    if here:
        check_local_device(c, cfg)
    if run_dir:
        check_run_dir(c, cfg)
    _check_checkpoint(c, cfg)
    if model_ok and cluster_ok and not c.reported("cluster.signal_seconds"):
        check_signal_lead(c, cfg)
    if for_launch and model_ok and not c.reported("run.dir") and not c.reported("checkpoint.keep"):
        # A launch is refused; a script (perhaps written for a file system elsewhere) is
        # warned about by the launcher.
        check_disk_room(c, cfg)
    _check_speed(c, cfg)
    if for_launch:
        c.extend(check_runnable(cfg))
    for path, value in _floats(cfg):
        if not c.reported(path):
            c.finite(path, value)
    c.raise_if_any()


def _problems_of(cfg: RecipeConfig) -> list[Problem]:
    """Every problem `validate` finds in `cfg` (none: an empty list)."""
    try:
        validate(cfg)
    except RecipeError as error:
        return error.problems
    return []


def _floats(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted path, value) of every float field, lists included."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value
        elif isinstance(value, list) and all(isinstance(v, float) for v in value):
            yield from ((f"{prefix}{f.name}", v) for v in value if not math.isfinite(v))


def _check_model(c: Checks, cfg: RecipeConfig) -> bool:
    """Model shape rules; True when the shape is sound enough for the layout rules."""
    m = cfg.model
    positive_ints = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len")
    ok = all([c.at_least(f"model.{f}", getattr(m, f), 1) for f in positive_ints])
    ok = c.at_least("model.n_kv_heads", m.n_kv_heads, 0) and ok
    ok = c.at_least("model.head_dim", m.explicit_head_dim, 0) and ok
    for f in ("rope_theta", "norm_eps", "init_std"):
        c.positive(f"model.{f}", getattr(m, f))
    if not ok:
        return False
    if not m.explicit_head_dim and m.dim % m.n_heads:
        c.add(
            "model.dim",
            m.dim,
            f"not divisible by model.n_heads={m.n_heads} (heads need equal widths)",
            f"use a multiple of {m.n_heads}, e.g. {or_list(nearby_multiples(m.dim, m.n_heads))}",
        )
        ok = False
    if m.n_heads % m.kv_heads and not m.is_mla:
        c.add(
            "model.n_kv_heads",
            m.n_kv_heads,
            f"{m.n_heads} query heads cannot be grouped over {m.kv_heads} key/value heads",
            f"use a divisor of {m.n_heads}: {or_list(divisors(m.n_heads))}",
        )
        ok = False
    return ok


def _check_train(c: Checks, cfg: RecipeConfig) -> bool:
    """Length and batch rules; True when the batch shape is sound enough for the layout
    rules (train.steps does not enter them, so a bad one hides none of them)."""
    t = cfg.train
    if c.at_least("train.steps", t.steps, 1):
        c.at_most("train.steps", t.steps, MAX_STEPS, "more optimizer steps than any run takes")
    ok = all(
        [c.at_least(f"train.{f}", getattr(t, f), 1) for f in ("seq_len", "micro_batch")]
        + [c.at_least("train.global_batch", t.global_batch, 1)]
    )
    ok = ok and c.at_most(
        "train.global_batch", t.global_batch, MAX_GLOBAL_BATCH, "sequences per optimizer step"
    )
    m = cfg.model
    if c.at_least("model.mtp_layers", m.mtp_layers, 0) and m.mtp_layers >= t.seq_len >= 1:
        c.add(
            "model.mtp_layers",
            m.mtp_layers,
            f"depth k predicts the token k + 1 ahead: a sequence of train.seq_len={t.seq_len} "
            "leaves the deepest no target",
            f"use model.mtp_layers < {t.seq_len} (DeepSeek-V3 uses 1)",
        )
    c.at_least("model.mtp_loss_weight", m.mtp_loss_weight, 0)
    if t.seq_len > cfg.model.max_seq_len:
        c.add(
            "train.seq_len",
            t.seq_len,
            f"longer than model.max_seq_len={cfg.model.max_seq_len}",
            f"use train.seq_len <= {cfg.model.max_seq_len} or raise model.max_seq_len",
        )
    chunks_ok = c.at_least("train.loss_chunks", t.loss_chunks, 1)
    if chunks_ok and t.seq_len >= 1 and t.seq_len % t.loss_chunks:
        fits = or_list(_nearest_divisors(t.seq_len, t.loss_chunks))
        c.add(
            "train.loss_chunks",
            t.loss_chunks,
            f"does not divide train.seq_len={t.seq_len} (chunks split the sequence evenly)",
            f"use a divisor of {t.seq_len}, e.g. {fits}",
        )
    return ok


def _nearest_divisors(n: int, value: int) -> list[int]:
    """The two divisors of n closest to value, ascending."""
    return sorted(sorted(divisors(n), key=lambda d: abs(d - value))[:2])


def _check_optim(c: Checks, cfg: RecipeConfig) -> None:
    o, s, steps = cfg.optim, cfg.schedule, cfg.train.steps
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
    if o.state_dtype != "fp32" and o.name == "sgd":
        c.add(
            "optim.state_dtype",
            o.state_dtype,
            "SGD is torch's, with its momentum in FP32",
            "use optim.state_dtype=fp32 with sgd, or adamw, lion or muon for low-precision states",
        )
    if o.lr_scaling != "none" and o.base_batch <= 0:
        c.add(
            "optim.base_batch",
            o.base_batch,
            f"lr_scaling={o.lr_scaling} scales relative to the batch lr was tuned for",
            f"set optim.base_batch to that global batch (e.g. {cfg.train.global_batch})",
        )
    warm_ok = c.at_least("schedule.warmup_steps", s.warmup_steps, 0)
    decay_ok = c.at_least("schedule.decay_steps", s.decay_steps, 0)
    if not (steps >= 1 and warm_ok and decay_ok):
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


def _check_checkpoint(c: Checks, cfg: RecipeConfig) -> None:
    """Checkpoint cadence and the fault limits."""
    c.at_least("checkpoint.every", cfg.checkpoint.every, 0)
    c.at_least("checkpoint.keep", cfg.checkpoint.keep, 1)
    if c.at_least("checkpoint.hf_every", cfg.checkpoint.hf_every, 0) and cfg.checkpoint.hf_every:
        check_hf_every(c, cfg)
    c.at_least("cluster.max_restarts", cfg.cluster.max_restarts, 0)
    c.at_least("faults.max_bad_steps", cfg.faults.max_bad_steps, 1)
    c.positive("faults.collective_timeout_s", cfg.faults.collective_timeout_s)
    c.positive("faults.straggler_lag", cfg.faults.straggler_lag)
    _check_timeouts(c, cfg)
    _check_recovery(c, cfg)


def check_hf_every(c: Checks, cfg: RecipeConfig) -> None:
    """A model that a Hugging Face folder can hold, written from shards it can be cut into."""
    every = cfg.checkpoint.hf_every
    refusal = export_refusal(cfg.model, expert_node_groups(cfg))
    if refusal is not None:
        c.add(
            "checkpoint.hf_every",
            every,
            "the model " + refusal.replace(":\n", ": ", 1).replace("\n", "; "),
            "set checkpoint.hf_every=0 (resume-only checkpoints), or change the model",
        )
    tp = cfg.parallel.tp
    if tp > 1 and cfg.model.vocab_size % tp:
        c.add(
            "checkpoint.hf_every",
            every,
            f"parallel.tp={tp} pads the vocabulary of {cfg.model.vocab_size} to a multiple of "
            "it, and the ranks write the embedding's shards as they hold them, padding and all",
            "export a checkpoint with `pretrain export` (it drops the padding), or use a "
            f"vocabulary divisible by {tp}",
        )


def _check_timeouts(c: Checks, cfg: RecipeConfig) -> None:
    """The rule that sets timeouts from measured times."""
    f = cfg.faults
    if c.at_least("faults.timeout_factor", f.timeout_factor, 0) and 0 < f.timeout_factor < 2:
        c.add(
            "faults.timeout_factor",
            f.timeout_factor,
            "a timeout under twice a phase's measured time fires on its ordinary variation",
            "use 2 or more (10 by default), or 0 to keep faults.collective_timeout_s",
        )
    c.positive("faults.timeout_floor_s", f.timeout_floor_s)
    c.at_least("faults.first_step_timeout_s", f.first_step_timeout_s, 0)


def _check_recovery(c: Checks, cfg: RecipeConfig) -> None:
    """The spike rule and what a rollback needs."""
    f = cfg.faults
    if f.spike_factor <= 1:
        c.add("faults.spike_factor", f.spike_factor, "a spike is a loss above the median "
              "times this, so it must be > 1", "use e.g. 3")  # fmt: skip
    c.at_least("faults.spike_window", f.spike_window, 1)
    if not 0 < f.rollback_lr_factor <= 1:
        c.add("faults.rollback_lr_factor", f.rollback_lr_factor, "it multiplies the learning "
              "rate after a rollback", "use a value in (0, 1], 1 to keep it")  # fmt: skip
    c.at_least("faults.rollback_lr_steps", f.rollback_lr_steps, 0)
    rolls_back = [k for k in ("on_nan", "on_spike", "on_alert") if getattr(f, k) == "rollback"]
    if rolls_back and cfg.checkpoint.every == 0:
        c.add(f"faults.{rolls_back[0]}", "rollback", "a rollback reloads the newest periodic "
              "checkpoint, and checkpoint.every=0 writes none", "set checkpoint.every "
              "(e.g. 100), or use skip or halt")  # fmt: skip
    versions = SCHEDULES[cfg.parallel.pp_schedule].weight_versions if cfg.parallel.pp > 1 else 1
    late = [k for k, v in (("on_spike", "none"), ("on_alert", "none")) if getattr(f, k) != v]
    late += ["on_nan"] if f.on_nan == "rollback" else []
    if versions > 1 and late:
        c.add(f"faults.{late[0]}", getattr(f, late[0]), f"parallel.pp_schedule="
              f"{cfg.parallel.pp_schedule} agrees on a step after the next one has begun, "
              "too late to keep or roll back its update", "use skip or halt (on_nan), none "
              "(on_spike, on_alert), or another pp_schedule")  # fmt: skip
    if f.on_alert != "none" and cfg.logging.stability_every == 0:
        c.add("faults.on_alert", f.on_alert, "it acts on the stability monitors' alerts, and "
              "logging.stability_every=0 samples none", "set logging.stability_every (e.g. "
              "100), or faults.on_alert=none")  # fmt: skip
    armed = {**STABILITY_ALERTS, **cfg.logging.stability_alerts}
    if f.on_alert != "none" and not any(t > 0 for t in armed.values()):
        c.add("faults.on_alert", f.on_alert, "every threshold of logging.stability_alerts is "
              "0 (off), so no alert can fire", "set one, e.g. "
              "logging.stability_alerts.attn_logit_max=100")  # fmt: skip


def _check_speed(c: Checks, cfg: RecipeConfig) -> None:
    """Compile, overlap and prefetch settings."""
    k = cfg.compile
    if k.enabled and not (k.blocks or k.loss):
        c.add(
            "compile.enabled",
            k.enabled,
            "compile.blocks and compile.loss are both false, so nothing would be compiled",
            "set compile.blocks=true and/or compile.loss=true, or compile.enabled=false",
        )
    c.at_least("parallel.fsdp_prefetch", cfg.parallel.fsdp_prefetch, 0)
    c.positive("parallel.ddp_bucket_mb", cfg.parallel.ddp_bucket_mb)
    c.at_least("data.prefetch", cfg.data.prefetch, 0)
