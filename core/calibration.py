"""A hardware calibration: the rates `action=calibrate` measured on a job's ranks, kept where
the planner finds them (the ranks write it; the launcher reads it).

It lives in data.cache_dir/hardware (beside the measured CPU peak), one file per kind of
machine: the device and GPU type, the ranks per node and the threads each runs, and on a CPU
the host, whose cores the ranks share. A file that cannot be read as one is ignored (the
plan says so and prices steps from the GPU table).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, read_mapping
from pretrain.core.schema import RecipeConfig

FOLDER = "hardware"
"""Folder under data.cache_dir that holds the calibrations (and the measured CPU peaks)."""


@dataclass(frozen=True)
class Calibration:
    """What one calibration measured, in the units the cost model prices at."""

    gemm: tuple[tuple[float, float], ...]
    """(FLOPs of one GEMM, TFLOP/s) at the run's shapes, fewest FLOPs first."""
    attention: tuple[tuple[float, float], ...]
    """(keys per query, TFLOP/s) of causal attention forward and backward, counted as
    FlashAttention's benchmarks count them."""
    memory_gbs: float
    """GB/s a block's element-wise work (a norm, SwiGLU's activation) streams at the run's
    size, its bytes counted as the cost model counts them."""
    loss_gbs: float
    """GB/s the loss streams its FP32 logits at, counted likewise."""
    links: dict[str, float]
    """Achieved bus bandwidth (GB/s) and per-step latency (us) inside a node and, where the
    job spanned nodes, between them: the `hardware.*` link fields' names."""
    measured: str
    world: int
    layouts: list[dict[str, Any]] = field(default_factory=list)
    """Layouts timed in the same job: {"overrides": [...], "key": `layout_key`, "step_s":
    [...], "ops": operators one step dispatched on rank 0, "dtensor_ops": those of them on
    DTensors}."""
    op_s: float = 0.0
    """Seconds one dispatched operator costs beyond its arithmetic (the framework's)."""
    path: Path | None = None
    fsdp_call_s: float = 0.0
    """Seconds one FSDP2 collective (a unit's all-gather or reduce-scatter) costs beyond
    the bytes it moves: its latency, copies and hooks."""
    dtensor_op_s: float = 0.0
    """Seconds one operator on DTensors costs beyond its arithmetic (sharding propagation
    and the local operator's dispatch)."""
    tp_call_s: float = 0.0
    """Seconds one tensor-parallel collective costs beyond its bytes as DTensor issues it (a
    redistribution through functional collectives and their autograd wrappers)."""

    def step_ops(self, cfg: RecipeConfig) -> tuple[int, int]:
        """Operators a step of `cfg`'s layout dispatched here, and how many of them on
        DTensors ((0, 0) where it was not timed)."""
        key = layout_key(cfg)
        timed = next((x for x in self.layouts if x.get("key") == key), {})
        return int(timed.get("ops", 0)), int(timed.get("dtensor_ops", 0))


def calibration_path(cfg: RecipeConfig) -> Path:
    """Where the calibration of the machine `cfg` runs on is kept."""
    c = cfg.cluster
    host = platform.node() if c.device == "cpu" else ""
    machine = [c.device, c.gpu_type, c.gpus_per_node, c.omp_num_threads, host]
    key = hashlib.sha256(json.dumps(machine).encode()).hexdigest()[:16]
    cache = Path(os.path.expanduser(cfg.data.cache_dir))
    return cache / FOLDER / f"calibration-{key}.json"


def write_calibration(path: Path, record: dict[str, Any]) -> None:
    """Write `record` to `path` whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def read_calibration(path: Path) -> Calibration | None:
    """The calibration kept in `path`; None when there is none or it is not one."""
    try:
        data = read_mapping(path, "a hardware calibration (action=calibrate)")
        gemm = _points(data["gemm"])
        attention = _points(data["attention"])
        memory = float(data["memory_gbs"])
        loss = float(data["loss_gbs"])
        links = {str(k): float(v) for k, v in dict(data["links"]).items()}
        layouts = [dict(x) for x in data.get("layouts", [])]
        world = int(data["world"])
        op_s = float(data.get("op_s", 0.0))
        fsdp_call_s = float(data.get("fsdp_call_s", 0.0))
        dtensor_op_s = float(data.get("dtensor_op_s", 0.0))
        tp_call_s = float(data.get("tp_call_s", 0.0))
    except (ReadError, KeyError, TypeError, ValueError):
        return None
    if not gemm or not attention or memory <= 0 or loss <= 0:
        return None
    return Calibration(gemm, attention, memory, loss, links, str(data.get("measured", "")),
                       world, layouts, op_s, path, fsdp_call_s, dtensor_op_s,
                       tp_call_s)  # fmt: skip


def _points(value: Any) -> tuple[tuple[float, float], ...]:
    points = sorted((float(x), float(y)) for x, y in value)
    if any(x <= 0 or y <= 0 for x, y in points):
        raise ValueError("not positive")
    return tuple(points)


LAYOUT_FIELDS = ("parallel.", "recompute.", "train.micro_batch")
"""The fields a calibrated layout may set (calibrate.layouts)."""


def layout_variants(cfg: RecipeConfig) -> list[tuple[list[str], RecipeConfig]]:
    """The layouts action=calibrate times: the recipe's own (no overrides), then each of
    calibrate.layouts applied to it. ValueError names an entry that sets another field or
    does not parse."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pretrain.core.schema import to_recipe

    variants: list[tuple[list[str], RecipeConfig]] = [([], cfg)]
    if not cfg.calibrate.layouts:
        return variants
    base = OmegaConf.structured(cfg)
    for entry in cfg.calibrate.layouts:
        items = entry.split()
        wrong = [i for i in items if "=" not in i or not i.startswith(LAYOUT_FIELDS)]
        if not items or wrong:
            raise ValueError(
                f"calibrate.layouts entry {entry!r}: each item must set a layout field "
                f"({', '.join(LAYOUT_FIELDS)}...) as key=value"
            )
        try:
            variant = to_recipe(OmegaConf.merge(base, OmegaConf.from_dotlist(items)))
        except OmegaConfBaseException as error:
            raise ValueError(f"calibrate.layouts entry {entry!r}: {error}") from None
        variants.append((items, variant))
    return variants


def layout_key(cfg: RecipeConfig) -> str:
    """What makes two recipes' steps dispatch the same operators: the model, the layout and
    the batch shapes."""
    m, p = cfg.model, cfg.parallel
    return json.dumps(
        [m.name, m.dim, m.n_layers, m.moe_experts, cfg.train.micro_batch, cfg.train.seq_len,
         cfg.train.global_batch, p.tp, p.sp, p.pp, p.vpp, p.pp_schedule, p.cp, p.ep, p.zero,
         p.dp_replicate, p.dp_shard, cfg.recompute.policy, cfg.precision.dtype]
    )  # fmt: skip
