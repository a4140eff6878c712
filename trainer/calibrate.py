"""One rank of action=calibrate: measure the rates the cost model prices a step at, on the
job's own ranks and at the run's own sizes, then time the step of each layout asked for, in
the same job, so that the rates and the steps see the same machine and the same load.

The launcher wrote what to measure into the run dir's plan.json (`calibration_probe`: the
GEMM shapes of the blocks and head, attention's batch, heads, sequence and head dim, the
activation size, the messages) and which layouts to time (`calibration_layouts`). Every rank
measures at once, as every rank computes at once in training; rank 0 writes the result to
the machine's calibration file (`pretrain.core.calibration`). A layout is timed on synthetic
token batches through the trainer's own build and stepper (no data, checkpoint or metrics),
one untimed step first, each step's time the slowest rank's; the probe runs before the
first layout and after the last. On a CPU every time is the rank's CPU time (its own and
its communication threads'), not the wall clock: the machine's other work preempts the
ranks for as long as it runs, which neither rates nor steps should count.
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.core.calibration import (
    calibration_path,
    layout_key,
    layout_variants,
    write_calibration,
)
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

MIN_TIMED_S = 0.02
"""Least time one measurement repeats its operation for."""
REPEATS = 3
"""Measurements per probe and round; their median is kept."""
ATTENTION_BACKWARD = 2.5
"""Attention's backward FLOPs over its forward's, as FlashAttention's benchmarks count."""


def calibrate(cfg: RecipeConfig, rank: RankInfo) -> None:
    """Measure this job's rates and time its layouts; rank 0 writes the calibration."""
    plan = read_mapping(Path(cfg.run.dir) / PLAN_FILE, "the calibration job's plan.json")
    probe: dict[str, Any] = plan["calibration_probe"]
    device = rank.device
    log = get_logger()
    variants = {tuple(o): v for o, v in layout_variants(cfg)}
    # The probe runs before the first layout and after the last, so that its rates (the
    # mean of the two) and the steps between see the same load.
    rounds: list[dict[str, Any]] = [_rates(cfg, rank, probe, device)]
    layouts = []
    for overrides in plan["calibration_layouts"]:
        variant = variants[tuple(overrides)]
        stepping = _Stepping(variant, device)
        seconds = stepping.time(cfg.calibrate.steps)
        stepping.close()
        layouts.append(
            {
                "overrides": overrides,
                "key": layout_key(variant),
                "step_s": seconds,
                "ops": stepping.ops,
                "dtensor_ops": stepping.dtensor_ops,
            }
        )
        log.info("calibration: %s timed", " ".join(overrides) or "the recipe's layout")
    rounds.append(_rates(cfg, rank, probe, device))
    record = {
        "measured": time.strftime("%F %T"),
        "world": rank.world_size,
        "device": device.type,
        **_medians(rounds),
        "layouts": layouts,
    }
    if rank.is_main:
        path = calibration_path(cfg)
        write_calibration(path, record)
        log.info("calibration written to %s", path)


def _rates(
    cfg: RecipeConfig, rank: RankInfo, probe: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """One round of the probe: GEMMs, attention, an element-wise op and the links."""
    dtype = torch.float32 if cfg.precision.dtype == "fp32" else torch.bfloat16
    return {
        "gemm": [_gemm(m, n, k, dtype, device) for m, n, k in probe["gemms"]],
        "attention": [_attention(*shape, dtype, device) for shape in probe["attention"]],
        "memory_gbs": _elementwise(*probe["elementwise"], dtype, device),
        "loss_gbs": _loss(*probe["loss"], device),
        "op_s": _op_seconds(dtype, device),
        "fsdp_call_s": _fsdp_call_seconds(rank, device),
        "dtensor_op_s": _dtensor_op_seconds(rank, device),
        "tp_call_s": _tp_call_seconds(rank, device),
        "links": _links(cfg, rank, probe, device),
    }


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rate's median over the rounds."""
    first = rounds[0]

    def median_points(key: str) -> list[list[float]]:
        return [
            [point[0], statistics.median(r[key][i][1] for r in rounds)]
            for i, point in enumerate(first[key])
        ]

    return {
        "gemm": median_points("gemm"),
        "attention": median_points("attention"),
        "memory_gbs": statistics.median(r["memory_gbs"] for r in rounds),
        "loss_gbs": statistics.median(r["loss_gbs"] for r in rounds),
        "op_s": statistics.median(r["op_s"] for r in rounds),
        "fsdp_call_s": statistics.median(r["fsdp_call_s"] for r in rounds),
        "dtensor_op_s": statistics.median(r["dtensor_op_s"] for r in rounds),
        "tp_call_s": statistics.median(r["tp_call_s"] for r in rounds),
        "links": {k: statistics.median(r["links"][k] for r in rounds) for k in first["links"]},
    }


def _clock(device: torch.device) -> Callable[[], float]:
    """The clock a rank measures with: wall time on a GPU (after synchronizing), the
    process's CPU time on a CPU, so that other work on the machine's cores, which preempts
    the ranks for as long as it runs, counts in neither the rates nor the steps."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds`."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(work: Callable[[], object], device: torch.device) -> float:
    """Median seconds of one `work()` over REPEATS measurements, each repeating it for at
    least MIN_TIMED_S, every rank measuring at the same time and as often (a collective
    must be called as many times on every rank); each measurement the slowest rank's."""
    clock = _clock(device)
    _sync(device)
    start = clock()
    work()  # warm-up: the kernels are chosen, the buffers allocated
    _sync(device)
    once = torch.tensor([clock() - start], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    calls = max(1, math.ceil(MIN_TIMED_S / max(float(once.item()), 1e-6)))
    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        start = clock()
        for _ in range(calls):
            work()
        _sync(device)
        samples.append(_slowest((clock() - start) / calls, device))
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


def _elementwise(
    tokens: int, dim: int, ffn: int, dtype: torch.dtype, device: torch.device
) -> float:
    """GB/s of a block's element-wise work as the cost model counts its bytes
    (launcher/plan/compute.py): an RMS norm over `dim` (a read and a write per element
    forward, twice that backward) and SwiGLU's activation over `ffn` (two reads and a write
    forward, twice that backward), forward and backward at the run's size."""
    x = torch.randn(tokens, dim, dtype=dtype, device=device, requires_grad=True)
    weight = torch.ones(dim, dtype=dtype, device=device, requires_grad=True)
    gate, up = (
        torch.randn(tokens, ffn, dtype=dtype, device=device, requires_grad=True) for _ in "gu"
    )

    def step() -> None:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        normed.sum().backward()
        (F.silu(gate) * up).sum().backward()

    seconds = _timed(step, device)
    size = x.element_size()
    return tokens * size * (3 * 2 * dim + 3 * 3 * ffn) / seconds / 1e9


def _loss(tokens: int, vocab: int, device: torch.device) -> float:
    """GB/s of the loss over FP32 logits as the cost model counts its bytes (14 per logit:
    written and read forward, read and its gradient written backward), forward and backward
    at the run's size."""
    logits = torch.randn(tokens, vocab, dtype=torch.float32, device=device, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=device)

    def step() -> None:
        F.cross_entropy(logits, target).backward()

    seconds = _timed(step, device)
    return tokens * vocab * 14 / seconds / 1e9


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


class _OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while active (each one a kernel launch on a GPU, an
    eager call through the dispatcher on a CPU), and among them those on DTensors (seen here
    before DTensor dispatches their local operators) and the collectives, of process groups
    (c10d) or functional (as DTensor issues them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.dtensor_ops = 0
        self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.dtensor_ops += DTensor in types
        namespace = getattr(func, "namespace", "")
        name = str(getattr(func, "overloadpacket", ""))
        functional = namespace == "_c10d_functional" and name.split(".")[-1] in FUNCTIONAL
        self.collectives += namespace == "c10d" or functional
        return func(*args, **(kwargs or {}))


FUNCTIONAL = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
"""The functional collectives that move data (not their waits or autograd wrappers)."""


class _Chain(torch.nn.Module):
    """A few small square matrices applied in turn: an FSDP unit of several parameters
    whose arithmetic and bytes are negligible."""

    def __init__(self, count: int, width: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.eye(width)) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = x @ weight
        return x


def _fsdp_call_seconds(rank: RankInfo, device: torch.device) -> float:
    """Seconds one FSDP2 collective costs beyond the bytes it moves (its latency, the copies
    into and out of its buffer, the hooks around it): four units of tiny parameters and a
    root sharded over every rank as ZeRO-3 shards a block, forward and backward, against the
    same model unsharded, over the collectives it issued. 0 on one rank."""
    if rank.world_size == 1:
        return 0.0

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*(_Chain(4, 8) for _ in range(4)), _Chain(1, 8)).to(device)

    plain, sharded = model(), model()
    mesh = _world_mesh(rank, device)
    for unit in list(sharded)[:-1]:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(1, 8, device=device)

    def step(module: torch.nn.Module) -> Callable[[], None]:
        return lambda: module(x).sum().backward()

    counter = _OpCounter()
    with counter:
        step(sharded)()
    if counter.collectives == 0:
        return 0.0
    extra = _timed(step(sharded), device) - _timed(step(plain), device)
    return max(0.0, extra) / counter.collectives


def _op_seconds(dtype: torch.dtype, device: torch.device) -> float:
    """Seconds one dispatched operator costs beyond its arithmetic: a two-layer MLP's
    forward and backward on a one-element batch, over the operators it dispatches."""
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU(), torch.nn.Linear(16, 16)).to(
        device=device, dtype=dtype
    )
    x = torch.randn(1, 16, dtype=dtype, device=device, requires_grad=True)

    def step() -> None:
        mlp(x).sum().backward()

    return _seconds_per(step, device, lambda counted: counted.ops)


def _seconds_per(
    step: Callable[[], None], device: torch.device, count: Callable[[_OpCounter], int]
) -> float:
    """Seconds of one `step()` (`_timed`) over the operators of a kind it dispatches, `count`
    of the counter of one untimed step."""
    counter = _OpCounter()
    with counter:
        step()
    return _timed(step, device) / max(1, count(counter))


def _dtensor_op_seconds(rank: RankInfo, device: torch.device) -> float:
    """Seconds one operator on DTensors costs beyond its arithmetic: element-wise operators
    and their backward on tiny sequence-sharded DTensors (no collective), over the DTensor
    operators they dispatch. 0 on one rank."""
    if rank.world_size == 1:
        return 0.0
    mesh = _world_mesh(rank, device)
    local = torch.randn(2, 8, device=device, requires_grad=True)

    def step() -> None:
        x = DTensor.from_local(local, mesh, [Shard(0)])
        (F.silu(x) * x + x).to_local().sum().backward()

    return _seconds_per(step, device, lambda counted: counted.dtensor_ops)


def _tp_call_seconds(rank: RankInfo, device: torch.device) -> float:
    """Seconds one tensor-parallel collective costs beyond its bytes as DTensor issues it
    under sequence parallelism: a tiny sequence-sharded activation all-gathered forward and
    its partial gradient reduce-scattered backward, over the collectives issued. 0 on one
    rank."""
    if rank.world_size == 1:
        return 0.0
    mesh = _world_mesh(rank, device)
    local = torch.randn(2, 8, device=device, requires_grad=True)

    def step() -> None:
        gathered = DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        gathered.to_local(grad_placements=[Partial()]).sum().backward()

    return _seconds_per(step, device, lambda counted: counted.collectives)


def _world_mesh(rank: RankInfo, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh of every rank (the default process group's)."""
    return init_device_mesh(device.type, (rank.world_size,))


class _Stepping:
    """A layout's trainer state, built on this job's ranks, and its steps timed on
    synthetic batches (one untimed first)."""

    def __init__(self, cfg: RecipeConfig, device: torch.device) -> None:
        degrees = resolve_degrees(cfg)
        torch.manual_seed(cfg.seed)
        mesh = build_mesh(degrees, device.type)
        state = build_train_state(cfg, mesh, device)
        state.phases = StepPhases(device)
        guard = StepGuard(cfg.faults.max_bad_steps, device, cfg.faults)
        ctx = StepContext(state, cfg, degrees, device, mesh, guard)
        self.device = device
        self.stepper: Stepper | None = pipeline_step(ctx) if degrees.pp > 1 else LocalStep(ctx)
        self.batches = synthetic_batches(cfg, device)
        self.time(1)
        counter = _OpCounter()
        with counter:
            self.time(1)
        self.ops = counter.ops
        """Operators one step dispatches on this rank."""
        self.dtensor_ops = counter.dtensor_ops
        """Of them, those on DTensors."""

    def time(self, steps: int) -> list[float]:
        """Seconds of each of `steps` steps, each the slowest rank's."""
        assert self.stepper is not None
        clock = _clock(self.device)
        seconds = []
        for _ in range(steps):
            dist.barrier()
            start = clock()
            self.stepper.step(self.batches)
            _sync(self.device)
            seconds.append(_slowest(clock() - start, self.device))
        return seconds

    def close(self) -> None:
        """Let the layout's state go before the next is built."""
        self.stepper = None
        gc.collect()
