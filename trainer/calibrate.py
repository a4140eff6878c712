"""One rank of action=calibrate: measure the rates the cost model prices a step at, on the
job's own ranks and at the run's own sizes, then time the step of each layout asked for, in
the same job, so that the rates and the steps see the same machine and the same load.

The launcher wrote what to measure into the run dir's plan.json (`calibration_probe`: the
GEMM shapes of the blocks and head, attention's batch, heads, sequence and head dim, the
activation size, the messages) and which layouts to time (`calibration_layouts`). Every rank
measures at once, as every rank computes at once in training; rank 0 writes the result to
the machine's calibration file (`pretrain.core.calibration`). A layout is timed on synthetic
token batches through the trainer's own build and stepper (no data, checkpoint or metrics),
one untimed step first, each step ended by a barrier so its time is the slowest rank's.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.core.calibration import calibration_path, layout_variants, write_calibration
from pretrain.core.inputs.reading import read_mapping
from pretrain.core.layout import resolve_degrees
from pretrain.core.run.rundir import PLAN_FILE
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.dist import RankInfo
from pretrain.trainer.dryrun.run import synthetic_batches
from pretrain.trainer.faults.step_guard import StepGuard
from pretrain.trainer.log import get_logger
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import LocalStep
from pretrain.trainer.step.phases import StepPhases
from pretrain.trainer.step.pipeline import pipeline_step
from pretrain.trainer.step.state import Stepper

MIN_TIMED_S = 0.05
"""Least time one measurement repeats its operation for."""
REPEATS = 5
"""Measurements per probe; their median is kept."""
ATTENTION_BACKWARD = 2.5
"""Attention's backward FLOPs over its forward's, as FlashAttention's benchmarks count."""


def calibrate(cfg: RecipeConfig, rank: RankInfo) -> None:
    """Measure this job's rates and time its layouts; rank 0 writes the calibration."""
    plan = read_mapping(Path(cfg.run.dir) / PLAN_FILE, "the calibration job's plan.json")
    probe: dict[str, Any] = plan["calibration_probe"]
    device = rank.device
    dtype = torch.float32 if cfg.precision.dtype == "fp32" else torch.bfloat16
    log = get_logger()
    record: dict[str, Any] = {
        "measured": time.strftime("%F %T"),
        "world": rank.world_size,
        "device": device.type,
        "gemm": [_gemm(m, n, k, dtype, device) for m, n, k in probe["gemms"]],
        "attention": [_attention(*shape, dtype, device) for shape in probe["attention"]],
        "memory_gbs": _memory(probe["elementwise_bytes"], dtype, device),
        "links": _links(cfg, rank, probe, device),
    }
    log.info("calibration: rates measured; timing %d layout(s)", len(plan["calibration_layouts"]))
    variants = {tuple(o): v for o, v in layout_variants(cfg)}
    record["layouts"] = [
        {"overrides": overrides, "step_s": _steps(variants[tuple(overrides)], device)}
        for overrides in plan["calibration_layouts"]
    ]
    if rank.is_main:
        path = calibration_path(cfg)
        write_calibration(path, record)
        log.info("calibration written to %s", path)


def _timed(work: Callable[[], object], device: torch.device) -> float:
    """Median seconds of one `work()` over REPEATS measurements, each repeating it for at
    least MIN_TIMED_S, every rank measuring at the same time and as often (a collective
    must be called as many times on every rank)."""
    _sync(device)
    start = time.perf_counter()
    work()  # warm-up: the kernels are chosen, the buffers allocated
    _sync(device)
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    calls = max(1, math.ceil(MIN_TIMED_S / max(float(once.item()), 1e-6)))
    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            work()
        _sync(device)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[float]:
    """[FLOPs, TFLOP/s] of an (m x k) @ (k x n) GEMM."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    seconds = _timed(lambda: torch.mm(a, b, out=out), device)
    flops = 2.0 * m * n * k
    return [flops, flops / seconds / 1e12]


def _attention(
    batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[float]:
    """[keys per query, TFLOP/s] of causal attention forward and backward (the causal half
    of the square, the backward at 2.5 times the forward)."""
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    grad = torch.randn(shape, dtype=dtype, device=device)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    seconds = _timed(step, device)
    forward = 4.0 * batch * heads * seq * seq * head_dim / 2
    return [float(seq), forward * (1 + ATTENTION_BACKWARD) / seconds / 1e12]


def _memory(nbytes: int, dtype: torch.dtype, device: torch.device) -> float:
    """GB/s of an element-wise add of two activations into a third (three streams)."""
    elements = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    a, b = (torch.randn(elements, dtype=dtype, device=device) for _ in "ab")
    out = torch.empty_like(a)
    seconds = _timed(lambda: torch.add(a, b, out=out), device)
    return 3 * a.nbytes / seconds / 1e9


def _links(
    cfg: RecipeConfig, rank: RankInfo, probe: dict[str, Any], device: torch.device
) -> dict[str, float]:
    """Achieved bus bandwidth (GB/s) and per-step latency (us) of all-reduces over the job's
    ranks (between nodes when it spans several) and over a node's ranks; an all-to-all and
    a send at the run's sizes are measured for the record."""
    world, per_node = rank.world_size, cfg.cluster.gpus_per_node
    found: dict[str, float] = {}
    groups: list[tuple[str, Any, int]] = []
    if cfg.cluster.nodes > 1:
        groups.append(("inter_node", None, world))
        if per_node > 1:
            node_groups = [
                dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
                for n in range(cfg.cluster.nodes)
            ]
            groups.append(("intra_node", node_groups[rank.rank // per_node], per_node))
    elif world > 1:
        groups.append(("intra_node", None, world))
    small, large = probe["all_reduce_bytes"]
    for name, group, size in groups:
        times = [_all_reduce(nbytes, group, device) for nbytes in (small, large)]
        steps = 2 * (size - 1)
        latency = times[0] / steps
        moved = 2 * (size - 1) / size * (large - small)
        found[f"{name}_gbs"] = moved / max(times[1] - times[0], 1e-9) / 1e9
        found[f"{name}_latency_us"] = latency * 1e6
    if world > 1:
        found["all_to_all_gbs"] = _all_to_all(probe["all_to_all_bytes"], world, device)
        found["send_gbs"] = _send(probe["send_bytes"], rank, device)
    return found


def _all_reduce(nbytes: int, group: Any, device: torch.device) -> float:
    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return _timed(lambda: dist.all_reduce(tensor, group=group), device)


def _all_to_all(nbytes: int, world: int, device: torch.device) -> float:
    """GB/s one rank sends in an even all-to-all of `nbytes` per rank."""
    elements = max(world, nbytes // 4 // world * world)
    send = torch.ones(elements, dtype=torch.float32, device=device)
    received = torch.empty_like(send)
    seconds = _timed(lambda: dist.all_to_all_single(received, send), device)
    return send.nbytes * (world - 1) / world / seconds / 1e9


def _send(nbytes: int, rank: RankInfo, device: torch.device) -> float:
    """GB/s of a send of `nbytes` to the neighbouring rank and its answer back (pairs of
    ranks; a rank without a partner waits)."""
    buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    partner = rank.rank ^ 1

    def exchange() -> None:
        if partner >= rank.world_size:
            return
        if rank.rank % 2 == 0:
            dist.send(buffer, partner)
            dist.recv(buffer, partner)
        else:
            dist.recv(buffer, partner)
            dist.send(buffer, partner)

    seconds = _timed(exchange, device)
    return 2 * buffer.nbytes / seconds / 1e9


def _steps(cfg: RecipeConfig, device: torch.device) -> list[float]:
    """Seconds of each of calibrate.steps steps of `cfg`'s layout, after an untimed one."""
    degrees = resolve_degrees(cfg)
    torch.manual_seed(cfg.seed)
    mesh = build_mesh(degrees, device.type)
    state = build_train_state(cfg, mesh, device)
    state.phases = StepPhases(device)
    guard = StepGuard(cfg.faults.max_bad_steps, device, cfg.faults)
    ctx = StepContext(state, cfg, degrees, device, mesh, guard)
    stepper: Stepper = pipeline_step(ctx) if degrees.pp > 1 else LocalStep(ctx)
    batches = synthetic_batches(cfg, device)
    seconds = []
    for step in range(cfg.calibrate.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        stepper.step(batches)
        _sync(device)
        dist.barrier()
        if step:
            seconds.append(time.perf_counter() - start)
    del stepper, ctx, state
    gc.collect()
    return seconds
