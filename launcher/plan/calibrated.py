"""The cost model on calibrated rates: what action=calibrate probes (the run's own GEMM
shapes, attention, element-wise size and messages, `probe_spec`), and the kernels and links
a calibration gives the plan and the layout search (`calibrated_device`).

A calibration replaces the GPU table's figures, not the model: GEMMs are priced at the rate
measured for the nearest size (interpolated over log FLOPs), attention at the measured
causal rate, element-wise work at the bandwidth measured at the run's activation size, and
every collective and send at the bus bandwidth and per-step latency the all-reduces
measured (the cost model's links, taken back from the achieved figure to the nominal one it
discounts by LINK_EFFICIENCY).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from pretrain.core import hardware
from pretrain.core.calibration import (
    Calibration,
    calibration_path,
    layout_variants,
    read_calibration,
)
from pretrain.core.hardware import KernelRates, Links
from pretrain.core.layout import Degrees, grad_accum_steps, resolve_degrees
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.comm.ep import ep_communication
from pretrain.launcher.plan.compute import Kernels, block_work
from pretrain.launcher.plan.cost import LINK_EFFICIENCY, step_cost, with_recipe_links
from pretrain.launcher.plan.memory import dispatch_padding, stage_params
from pretrain.models.flops import count_params

GEMM_SHAPES = 8
"""About this many of the run's GEMM shapes are measured, spread over their sizes."""
SMALL_MESSAGE = 4096
"""Bytes of the all-reduce that measures a collective step's latency."""


def calibrated_device(cfg: RecipeConfig) -> tuple[Kernels, Links, Calibration] | None:
    """The kernels and links of the calibration of `cfg`'s machine, where there is one."""
    found = read_calibration(calibration_path(cfg))
    if found is None:
        return None
    peak = max(tflops for _, tflops in found.gemm)
    rates = KernelRates(None, found.memory_gbs / 1e3, {"bf16": (1.0, (1, 1, 1))}, found.attention)
    source = f"calibrated {found.measured} ({found.path})"
    kernels = Kernels(
        {"bf16": peak, _dtype(cfg): peak},
        rates,
        source,
        found.gemm,
        found.op_s,
        found.step_ops,
        found.loss_gbs / 1e3,
        fsdp_call_s=found.fsdp_call_s,
        dtensor_op_s=found.dtensor_op_s,
        tp_call_s=found.tp_call_s,
    )
    table = hardware.links(cfg.cluster.gpu_type) if cfg.cluster.device == "cuda" else None
    measured = {k: v for k, v in found.links.items() if v > 0}
    intra = measured.get("intra_node_gbs", table.intra_node_gbs * LINK_EFFICIENCY if table else 0)
    inter = measured.get(
        "inter_node_gbs", table.inter_node_gbs * LINK_EFFICIENCY if table else intra
    )
    links = Links(
        intra / LINK_EFFICIENCY,
        inter / LINK_EFFICIENCY,
        measured.get("intra_node_latency_us", table.intra_node_latency_us if table else 0.0),
        measured.get(
            "inter_node_latency_us",
            table.inter_node_latency_us if table else measured.get("intra_node_latency_us", 0.0),
        ),
    )
    return kernels, links, found


def _dtype(cfg: RecipeConfig) -> str:
    return (
        "fp8"
        if cfg.precision.dtype == "fp8" and not cfg.precision.fp8_emulate
        else ("bf16" if cfg.precision.dtype == "fp8" else cfg.precision.dtype)
    )


def probe_spec(variants: list[RecipeConfig]) -> dict[str, Any]:
    """What the ranks measure for the cost model to price `variants` (one recipe in several
    layouts): every GEMM shape their blocks and head run, attention at their sequence and
    heads, element-wise work at their activation size, and all-reduces from a small message
    to their largest (the data-parallel gradients), an all-to-all and a send at their
    sizes."""
    gemms: set[tuple[int, int, int]] = set()
    largest = activation = exchange = 0.0
    elementwise = loss = (0, 0, 0)
    attention: set[tuple[int, int, int, int]] = set()
    for cfg in variants:
        d = resolve_degrees(cfg)
        tokens = cfg.train.micro_batch * cfg.train.seq_len // d.cp
        m = cfg.model
        kinds = {m.is_moe_layer(layer) for layer in range(m.n_layers)}
        for moe in kinds:
            work = block_work(m, moe, d, cfg.parallel.sp, dispatch_padding(cfg))
            for lin in work.linears:
                rows = max(1, round(tokens * lin.rows / lin.groups))
                gemms |= {(rows, lin.n, lin.k), (rows, lin.k, lin.n), (lin.k, lin.n, rows)}
        vocab = math.ceil(m.vocab_size / d.tp)
        gemms |= {(tokens, vocab, m.dim), (tokens, m.dim, vocab), (m.dim, vocab, tokens)}
        heads = max(1, m.n_heads // d.tp)
        attention.add((cfg.train.micro_batch, heads, cfg.train.seq_len // d.cp, m.qk_head_dim))
        c = COMPUTE_BYTES[cfg.precision.dtype]
        activation = max(activation, tokens * m.dim * c)
        elementwise = max(elementwise, (tokens, m.dim, max(1, m.ffn_dim // d.tp)))
        loss = max(loss, (tokens, vocab, 0))
        largest = max(largest, _gradient_bytes(cfg, d), activation)
        comm = ep_communication(cfg, d)
        exchange = max(exchange, comm.message_bytes if comm else activation)
    by_size = sorted(gemms, key=lambda s: (s[0] * s[1] * s[2], s))
    # A few shapes, spread from the smallest GEMM to the largest (interpolated between).
    step = max(1, math.ceil(len(by_size) / GEMM_SHAPES))
    chosen = sorted({*by_size[::step], by_size[-1]}, key=lambda s: s[0] * s[1] * s[2])
    return {
        "gemms": chosen,
        "attention": sorted(attention),
        "elementwise": list(elementwise),
        "loss": list(loss[:2]),
        "all_reduce_bytes": [SMALL_MESSAGE, int(largest)],
        "all_to_all_bytes": int(exchange),
        "send_bytes": int(activation),
    }


def _gradient_bytes(cfg: RecipeConfig, d: Degrees) -> float:
    """FP32 gradient bytes of the largest pipeline rank's parameters on one tp rank."""
    counts = count_params(cfg.model)
    largest = max(sum(stage_params(cfg, r, counts)[:2]) for r in range(d.pp))
    return 4 * largest / d.tp


def calibration_note(found: Calibration) -> str:
    """One line saying the plan's rates were measured, when and where they are kept."""
    return (
        f"measured on this machine by action=calibrate ({found.measured}, {found.world} "
        f"ranks), kept in {found.path}; delete the file to price from the GPU table"
    )


def predicted_step_s(cfg: RecipeConfig) -> float | None:
    """The plan's step time of `cfg` at its machine's calibrated rates, as the calibration
    times a step (None without a calibration): on a GPU the step's wall time; on a CPU the
    ranks' CPU seconds (trainer/calibrate.py), so the plan's step less its idle time (the
    pipeline's fill and drain cost no CPU) with all its communication counted, hidden or
    not (a CPU rank's communication threads take CPU time from the same cores whether or not
    its compute runs beside them)."""
    device = calibrated_device(cfg)
    if device is None:
        return None
    kernels, links, _ = device
    degrees = resolve_degrees(cfg)
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    links = with_recipe_links(cfg, links)
    cost = step_cost(cfg, degrees, micro, kernels.peak["bf16"], links, kernels)
    if cfg.cluster.device == "cpu":
        return cost.compute + cost.communication + cost.muon
    return cost.total


def render_calibration(cfg: RecipeConfig, path: Path) -> str:
    """What a local action=calibrate says when its job ends: the rates it measured, then each
    layout it timed, the plan's step time at those rates against the measured one."""
    found = read_calibration(path)
    if found is None:
        return f"no calibration was written to {path}: see the job's log above"
    rates = [tflops for _, tflops in found.gemm]
    links = ", ".join(f"{name} {value:.3g}" for name, value in sorted(found.links.items()))
    lines = [
        f"calibration of {found.world} ranks kept in {path}:",
        f"  GEMMs at the run's shapes {min(rates):.3g}-{max(rates):.3g} TFLOP/s; attention "
        f"{found.attention[-1][1]:.3g} TFLOP/s; element-wise {found.memory_gbs:.3g} GB/s",
        f"  links (achieved GB/s, us per step): {links}",
        "layout | plan at these rates (s) | measured median (s) | plan / measured",
    ]
    variants = {tuple(overrides): variant for overrides, variant in layout_variants(cfg)}
    for timed in found.layouts:
        overrides = tuple(str(o) for o in timed.get("overrides", []))
        steps = sorted(float(x) for x in timed.get("step_s", []))
        variant = variants.get(overrides)
        if variant is None or not steps:
            continue
        measured = statistics.median(steps)
        predicted = predicted_step_s(variant) or 0.0
        name = " ".join(overrides) or "the recipe's own"
        lines.append(f"{name} | {predicted:.4g} | {measured:.4g} | {predicted / measured:.2f}")
    return "\n".join(lines)
