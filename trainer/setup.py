"""Everything a rank builds before its first step, in one place, so the loop only steps.

Mesh, model and optimizer (`pretrain.trainer.build`), the weights of init.from_hf, the step of the
layout (plain or pipelined), the data (prepared datasets, the training loader and the
evaluator over the validation split), the checkpointer (restored from the newest
checkpoint), the fault guard and injector, the metrics window and the metrics sinks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.inputs.reading import ReadError
from pretrain.core.layout import Degrees, grad_accum_steps, resolve_degrees
from pretrain.core.precision import peak_dtype
from pretrain.core.recompute import recomputed_blocks
from pretrain.core.run.ledger import append_record, job_record
from pretrain.core.schema import STABILITY_ALERTS, RecipeConfig
from pretrain.dataprep.tokenizer import load_tokenizer
from pretrain.models.flops import count_params, flops_per_token
from pretrain.parallel.mesh import JobMesh, build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.checkpoint.checkpointer import Checkpointer
from pretrain.trainer.checkpoint.hf_every import HFWriter
from pretrain.trainer.checkpoint.hf_import import load_hf_weights
from pretrain.trainer.checkpoint.run_state import run_states
from pretrain.trainer.data.loader import (
    DataLoader,
    RunData,
    open_datasets,
    packed_data,
    source_val_loaders,
    tokens_seen,
    train_loader,
    val_loader,
)
from pretrain.trainer.data.prefetch import PrefetchingLoader
from pretrain.trainer.data.schedule_metrics import phase_lines, ramp_metrics, step_work
from pretrain.trainer.dist import RankInfo
from pretrain.trainer.evals.tasks import task_evaluator
from pretrain.trainer.faults.injection import FaultInjector
from pretrain.trainer.faults.recovery import Recovery
from pretrain.trainer.faults.step_guard import StepGuard, clear_preempted
from pretrain.trainer.kernels import kernels_line
from pretrain.trainer.log import get_logger, setup_logging
from pretrain.trainer.observe.activation_probes import ActivationProbes
from pretrain.trainer.observe.compile_watch import CompileWatch
from pretrain.trainer.observe.goodput import GoodputLedger
from pretrain.trainer.observe.loggers import MetricsLogger
from pretrain.trainer.observe.metrics import PeakFlops, ThroughputMeter, resolve_peak_flops
from pretrain.trainer.observe.metrics_window import MetricsWindow
from pretrain.trainer.observe.run_identity import run_identity
from pretrain.trainer.observe.stability import StabilityMonitor
from pretrain.trainer.observe.startup import CLOCK
from pretrain.trainer.optim.distributed_muon import split_line
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.evaluate import Evaluator
from pretrain.trainer.step.local import LocalStep
from pretrain.trainer.step.phases import StepPhases
from pretrain.trainer.step.pipeline import pipeline_step
from pretrain.trainer.step.state import Stepper, TrainState


@dataclass
class Run:
    """One rank's run, ready for its first step."""

    cfg: RecipeConfig
    rank: RankInfo
    run_dir: Path
    state: TrainState
    stepper: Stepper
    loader: DataLoader | PrefetchingLoader
    evaluator: Evaluator
    checkpointer: Checkpointer
    guard: StepGuard
    faults: FaultInjector
    window: MetricsWindow
    metrics: MetricsLogger
    start: int
    """Steps already done (restored from a checkpoint); 0 for a fresh run."""
    goodput: GoodputLedger
    load_s: float
    """Seconds the checkpoint restore took."""
    recovery: Recovery


def _record_job(run_dir: Path, world_size: int, start: int) -> None:
    """Append this job's record to the run's ledger; a ledger that cannot be written is
    warned about, not a reason to stop training."""
    try:
        append_record(run_dir, job_record(os.environ, world_size, start))
    except (OSError, ReadError) as err:
        get_logger().warning("run dir %s: the ledger was not updated: %s", run_dir, err)


def setup(cfg: RecipeConfig, rank: RankInfo) -> Run:
    """Build this rank's run of `cfg` and restore its newest checkpoint."""
    setup_logging(rank.rank, cfg.logging.all_ranks)
    degrees = resolve_degrees(cfg)
    if degrees.world != rank.world_size:
        raise RuntimeError(
            f"the recipe's layout needs {degrees.world} ranks but torchrun started "
            f"{rank.world_size}; launch it with `pretrain` or fix cluster.gpus_per_node"
        )
    torch.manual_seed(cfg.seed)
    mesh = build_mesh(degrees, rank.device.type)
    CLOCK.mark("mesh")
    run_dir = Path(cfg.run.dir)
    if rank.is_main:
        # This run is the resumed one. Cleared before the model, data and checkpoint are
        # loaded, so that a run that cannot get that far is not requeued for ever on the
        # marker of an earlier stop.
        clear_preempted(run_dir)
    faults = FaultInjector.from_env(rank.rank)
    guard = StepGuard(cfg.faults.max_bad_steps, rank.device, cfg.faults)
    data = packed_data(cfg, open_datasets(cfg, rank.is_main, get_logger().info))
    CLOCK.mark("data open")
    state = build_train_state(cfg, mesh, rank.device)
    CLOCK.mark("model build")
    if cfg.init.from_hf:
        loaded = load_hf_weights(state.plain, cfg.model, cfg.init.from_hf)
        get_logger().info(f"loaded {loaded} weights from {cfg.init.from_hf} (init.from_hf)")
    state.loss_fn = faults.wrap_loss(state.loss_fn)
    _instrument(cfg, state, degrees, mesh, rank)
    doc_eos = data.eos_id if cfg.data.doc_mask else None
    stepper, moe_pp_group = _stepper(cfg, state, degrees, mesh, rank, guard, doc_eos)
    training = train_loader(cfg, data, mesh.dp.get_local_rank(), degrees.dp)
    loader = _prefetching(cfg, training, rank)
    evaluator = _evaluator(cfg, data, mesh, degrees, rank, stepper, state)
    states = run_states(state, loader, run_dir, rank.is_main, guard.spikes)
    hf = (
        HFWriter(run_dir, cfg, states.sharded["model"].state_dict)
        if cfg.checkpoint.hf_every
        else None
    )
    checkpointer = Checkpointer(
        run_dir, cfg.checkpoint, states, rank=rank.rank, world_size=rank.world_size,
        faults=faults, hf=hf,
    )  # fmt: skip
    start, load_s = _restore(checkpointer, run_dir, rank)
    CLOCK.mark("loaders and checkpoint")
    if start:
        get_logger().info("resumed from the checkpoint of step %d", start)
    cache = Path(os.path.expanduser(cfg.data.cache_dir))
    peak = resolve_peak_flops(rank.device, peak_dtype(cfg.precision), cfg.hardware, cache)
    window = _metrics_window(
        cfg, rank, state, guard, mesh, moe_pp_group, peak, _data_metrics(cfg, training, data)
    )
    metrics = _metrics_logger(cfg, rank, run_dir, degrees)
    recovery = _recovery(cfg, rank, metrics, guard, loader, start)
    _announce(cfg, rank, degrees, state, data, peak)
    CLOCK.mark("metrics and kernels")
    return Run(
        cfg,
        rank,
        run_dir,
        state,
        stepper,
        loader,
        evaluator,
        checkpointer,
        guard,
        faults,
        window,
        metrics,
        start,
        GoodputLedger(run_dir, rank.is_main),
        load_s,
        recovery,
    )


def _data_metrics(
    cfg: RecipeConfig, training: DataLoader, data: RunData
) -> Callable[[int], dict[str, Any]]:
    """What the data adds to a logged step's metrics: the tokens each source supplied, and
    under a ramp the step's batch, length and tokens trained."""
    return lambda step: {
        **tokens_seen(training.sampler, data.labels, cfg.train.seq_len, step),
        **ramp_metrics(training.sampler.ramp, step),
    }


def _restore(checkpointer: Checkpointer, run_dir: Path, rank: RankInfo) -> tuple[int, float]:
    """The step of the checkpoint restored (0: none) and the seconds it took; the main rank
    records the job, and the step it starts from, in the run's ledger."""
    began = time.time()
    start = checkpointer.restore()
    took = time.time() - began
    if rank.is_main:
        _record_job(run_dir, rank.world_size, start)
    return start, took


def _recovery(
    cfg: RecipeConfig,
    rank: RankInfo,
    metrics: MetricsLogger,
    guard: StepGuard,
    loader: DataLoader | PrefetchingLoader,
    start: int,
) -> Recovery:
    """The policies' actions on bad steps, with what earlier rollbacks left for `start`."""
    recovery = Recovery(Path(cfg.run.dir), rank.is_main, cfg.faults, metrics)
    recovery.resumed(start, loader)
    guard.audit = recovery.action
    return recovery


def _metrics_logger(
    cfg: RecipeConfig, rank: RankInfo, run_dir: Path, degrees: Degrees
) -> MetricsLogger:
    """The sinks of the main rank's metrics; on the first rank of another node, the W&B run
    of that node's system metrics."""
    return MetricsLogger(
        run_dir,
        is_main=rank.is_main,
        logging=cfg.logging,
        config=asdict(cfg),
        identity=run_identity(cfg, run_dir, degrees),
        total_steps=cfg.train.steps,
        node=rank.system_node,
    )


def _stepper(
    cfg: RecipeConfig,
    state: TrainState,
    degrees: Degrees,
    mesh: JobMesh,
    rank: RankInfo,
    guard: StepGuard,
    doc_eos: int | None,
) -> tuple[Stepper, torch.distributed.ProcessGroup | None]:
    """The step of the layout, and the pipeline group MoE metrics gather over (if any)."""
    ctx = StepContext(state, cfg, degrees, rank.device, mesh, guard, doc_eos)
    if degrees.pp > 1:
        stepper = pipeline_step(ctx)
        return stepper, stepper.group if cfg.model.moe_experts else None
    return LocalStep(ctx), None


def _instrument(
    cfg: RecipeConfig, state: TrainState, degrees: Degrees, mesh: JobMesh, rank: RankInfo
) -> None:
    """Give the state its step breakdown and the stability monitors of
    `logging.stability_every`, hooked into the model's views."""
    state.phases = StepPhases(rank.device)
    every = cfg.logging.stability_every
    probes = None
    if every > 0:
        views = [state.plain] + ([state.stash] if state.stash is not None else [])
        probes = ActivationProbes(
            views,
            cfg.model.n_layers,
            tp=degrees.tp,
            sp=cfg.parallel.sp,
            tp_group=mesh.world["tp"].get_group() if degrees.tp > 1 else None,
            device=rank.device,
            phases=state.phases,
        )
    state.stability = StabilityMonitor(
        every,
        {**STABILITY_ALERTS, **cfg.logging.stability_alerts},
        probes,
        n_layers=cfg.model.n_layers,
        stage_ranks=rank.world_size // degrees.pp,
        device=rank.device,
        phases=state.phases,
    )


def _evaluator(
    cfg: RecipeConfig,
    data: RunData,
    mesh: JobMesh,
    degrees: Degrees,
    rank: RankInfo,
    stepper: Stepper,
    state: TrainState,
) -> Evaluator:
    """The validation loss over this rank's share of the held-out split, and the downstream
    tasks, when due."""
    tokenizer = None
    if cfg.eval.tasks and cfg.eval.tasks_every > 0:
        tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size, report=get_logger().info)
    return Evaluator(
        cfg.eval.every,
        cfg.eval.batches,
        stepper,
        val_loader(cfg, data, mesh.dp.get_local_rank(), degrees.dp),
        dp_group=mesh.dp.get_group(),
        model=state.plain,
        device=rank.device,
        tasks=task_evaluator(cfg, tokenizer, stepper, mesh.dp),
        sources=source_val_loaders(cfg, data, mesh.dp.get_local_rank(), degrees.dp),
    )


def _prefetching(
    cfg: RecipeConfig, loader: DataLoader, rank: RankInfo
) -> DataLoader | PrefetchingLoader:
    """The loader, read ahead on a thread when data.prefetch asks (pinned on CUDA)."""
    if cfg.data.prefetch:
        pin = rank.device.type == "cuda"
        return PrefetchingLoader(loader, depth=cfg.data.prefetch, pin_memory=pin)
    return loader


def _metrics_window(
    cfg: RecipeConfig,
    rank: RankInfo,
    state: TrainState,
    guard: StepGuard,
    mesh: JobMesh,
    moe_pp_group: dist.ProcessGroup | None,
    peak: PeakFlops,
    data_metrics: Callable[[int], dict[str, Any]],
) -> MetricsWindow:
    """The window that gathers and reduces each logging interval's metrics on this rank."""
    return MetricsWindow(
        _throughput_meter(cfg, rank, peak),
        state=state,
        guard=guard,
        device=rank.device,
        dp_group=mesh.dp.get_group(),
        log_every=cfg.logging.log_every,
        straggler_lag=cfg.faults.straggler_lag,
        stage=mesh.world["pp"].get_local_rank(),  # 0 without a pipeline
        moe_pp_group=moe_pp_group,
        data_metrics=data_metrics,
        system_every_s=cfg.logging.system_every_s,
        compile_watch=CompileWatch(cfg.compile.enabled),
        pp_group=mesh.world["pp"].get_group() if cfg.parallel.pp > 1 else None,
    )


def _throughput_meter(cfg: RecipeConfig, rank: RankInfo, peak: PeakFlops) -> ThroughputMeter:
    """MFU counts the model's FLOPs per token; HFU adds the recomputed forwards. Under a
    ramp each step counts its own batch and sequence length."""
    flops = flops_per_token(cfg.model, cfg.train.seq_len)
    blocks = recomputed_blocks(cfg.recompute, cfg.model.n_layers)
    ramp = Ramp(cfg.train)
    return ThroughputMeter(
        tokens_per_step=cfg.train.global_batch * cfg.train.seq_len,
        model_flops_per_token=flops.train,
        hardware_flops_per_token=flops.with_recompute(
            cfg.recompute.policy, len(blocks) / cfg.model.n_layers, cfg.parallel.tp > 1
        ),
        devices=rank.world_size,
        peak=peak,
        step_work=step_work(cfg, ramp) if ramp.active else None,
    )


def _announce(
    cfg: RecipeConfig,
    rank: RankInfo,
    degrees: Degrees,
    state: TrainState,
    data: RunData,
    peak: PeakFlops,
) -> None:
    """The start-up lines: model size, layout, data, the peak MFU divides by, kernels."""
    if not rank.is_main:
        return
    params = count_params(cfg.model)
    active = f" ({params.active / 1e6:.2f}M active)" if params.moe_layers else ""
    log = get_logger()
    log.info(
        "%s: %.2fM parameters%s, world %d (dp %d, zero %d, tp %d%s, pp %d, ep %d), "
        "grad accum %d, %s sequences%s; %s peak %s TFLOP/s (%s)",
        cfg.name,
        params.total / 1e6,
        active,
        rank.world_size,
        degrees.dp,
        cfg.parallel.zero,
        degrees.tp,
        " with sp" if cfg.parallel.sp else "",
        degrees.pp,
        degrees.ep,
        grad_accum_steps(cfg),
        "+".join(f"{len(s):,}" for s in data.train),
        f" ({sum(len(s) for s in data.val):,} for validation)" if data.val else "",
        peak.dtype,
        "n/a" if peak.tflops is None else f"{peak.tflops:.4g}",
        peak.source,
    )
    log.info("%s", kernels_line(cfg, state, rank.device))
    for line in phase_lines(cfg, Ramp(cfg.train), data.labels):
        log.info("%s", line)
    split = split_line(state.optimizer)
    if split:
        log.info("%s", split)
