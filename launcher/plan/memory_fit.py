"""Refuse a recipe whose predicted peak memory per rank exceeds the device's, with fixes.

Asked after `validate` (a recipe must be sound before its memory means anything). The
prediction is `pretrain.launcher.plan.memory`'s breakdown; each suggestion is a one-field change of
the
recipe that the same model predicts to fit, so the user gets options that work.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

from pretrain.core import hardware
from pretrain.core.hardware import GIB
from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.problems import Problem, RecipeError, or_list
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.memory import MemoryBreakdown, peak_breakdown
from pretrain.launcher.validate.recipe import validate


def device_memory_gib(cfg: RecipeConfig) -> float | None:
    """Memory of one device in GiB; None on CPU, where nothing is compared."""
    if cfg.cluster.device != "cuda":
        return None
    return cfg.cluster.gpu_memory_gib or hardware.gpu_spec(cfg.cluster.gpu_type).memory_gib


def host_memory_gib(cfg: RecipeConfig) -> float | None:
    """This machine's memory per rank in GiB for a local CPU run (its ranks share it); None
    for any other run, whose nodes' memory is not known here."""
    if cfg.cluster.device != "cpu" or cfg.cluster.backend != "local":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total / GIB / max(1, cfg.cluster.gpus_per_node)


def predict(cfg: RecipeConfig) -> MemoryBreakdown:
    """The peak breakdown per rank of a recipe whose layout resolves (under pipeline
    parallelism, of the pipeline rank with the largest peak)."""
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    return peak_breakdown(cfg, resolve_degrees(cfg), micro)


def _setter(group: str, name: str, value: object) -> Callable[[RecipeConfig], None]:
    """A change that sets `group.name` to `value` (bound now, not when the loop moves on)."""
    return lambda c: setattr(getattr(c, group), name, value)


def _variants(cfg: RecipeConfig) -> list[tuple[str, Callable[[RecipeConfig], None]]]:
    p, t = cfg.parallel, cfg.train
    options: list[tuple[str, Callable[[RecipeConfig], None]]] = []
    for zero in range(p.zero + 1, 4):
        options.append((f"parallel.zero={zero}", _setter("parallel", "zero", zero)))
    tp = p.tp * 2
    while tp <= cfg.cluster.gpus_per_node:
        options.append((f"parallel.tp={tp}", _setter("parallel", "tp", tp)))
        tp *= 2
    options.append((f"parallel.pp={p.pp * 2}", lambda c: setattr(c.parallel, "pp", p.pp * 2)))
    if p.tp > 1 and not p.sp:
        options.append(("parallel.sp=true", lambda c: setattr(c.parallel, "sp", True)))
    for policy in ("selective", "full"):
        if cfg.recompute.policy != policy and not (
            policy == "selective" and cfg.recompute.policy == "full"
        ):
            options.append((f"recompute={policy}", _setter("recompute", "policy", policy)))
    if t.micro_batch > 1:
        options.append(
            (
                f"train.micro_batch={t.micro_batch // 2}",
                lambda c: setattr(c.train, "micro_batch", t.micro_batch // 2),
            )
        )
    return options


def fitting_changes(cfg: RecipeConfig, limit_gib: float) -> list[str]:
    """One-field changes predicted to fit `limit_gib`, each with its predicted peak."""
    found = []
    for label, change in _variants(cfg):
        candidate = copy.deepcopy(cfg)
        change(candidate)
        try:
            validate(candidate)
            peak = predict(candidate).total_gib
        except RecipeError:
            continue
        if peak <= limit_gib:
            found.append(f"{label} ({peak:.1f} GiB)")
    return found


def describe(breakdown: MemoryBreakdown) -> str:
    """The breakdown on one line: 'params 3.7 + grads 7.5 + ... GiB'."""
    parts = [f"{name} {size / GIB:.1f}" for name, size, _ in breakdown.rows() if size]
    return " + ".join(parts) + " GiB"


def check_fits(cfg: RecipeConfig) -> None:
    """Raise RecipeError when the predicted peak per rank of a valid recipe exceeds the
    device's memory, naming the one-field changes predicted to fit."""
    limit = device_memory_gib(cfg)
    where = cfg.cluster.gpu_type
    if limit is None:
        # On CPU the ranks allocate from this machine's memory: a model that cannot fit
        # there is refused before they try (and swap, or are killed).
        limit = host_memory_gib(cfg)
        where = f"this machine's memory per rank ({cfg.cluster.gpus_per_node} local ranks)"
    breakdown = predict(cfg)
    if not limit or breakdown.total_gib <= limit:
        return
    fixes = fitting_changes(cfg, limit)
    raise RecipeError(
        [
            Problem(
                "parallel",
                f"tp={cfg.parallel.tp},pp={cfg.parallel.pp},zero={cfg.parallel.zero}",
                f"predicted peak {breakdown.total_gib:,.1f} GiB per rank exceeds the "
                f"{limit:,.4g} GiB of {where} ({describe(breakdown)})",
                "try " + or_list(fixes)
                if fixes
                else "raise ZeRO, tp or pp, recompute, or lower "
                "train.micro_batch (no single change fits)",
            )
        ]
    )
