"""Everything a rank builds before its first step, in one place, so the loop only steps.

Mesh, model and optimizer (`pretrain.trainer.build`), the weights of init.from_hf, the step of the
layout (plain or pipelined), the data (prepared datasets, the training loader and the
evaluator over the validation split), the checkpointer (restored from the newest
checkpoint), the fault guard and injector, the metrics window and the metrics sinks.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pretrain.core.inputs.reading import ReadError
from pretrain.core.layout import Degrees, grad_accum_steps, resolve_degrees
from pretrain.core.precision import peak_dtype
from pretrain.core.recompute import recomputed_blocks
from pretrain.core.run.ledger import append_record, job_record
from pretrain.core.schema import RecipeConfig
from pretrain.models.flops import count_params, flops_per_token
from pretrain.parallel.mesh import JobMesh, build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.checkpoint.checkpointer import Checkpointer
from pretrain.trainer.checkpoint.hf_import import load_hf_weights
from pretrain.trainer.checkpoint.run_state import run_states
from pretrain.trainer.data.loader import (
    DataLoader,
    RunData,
    open_datasets,
    packed_data,
    tokens_seen,
    train_loader,
    val_loader,
)
from pretrain.trainer.data.prefetch import PrefetchingLoader
from pretrain.trainer.dist import RankInfo
from pretrain.trainer.faults.injection import FaultInjector
from pretrain.trainer.faults.recovery import Recovery
from pretrain.trainer.faults.step_guard import StepGuard, clear_preempted
from pretrain.trainer.kernels import kernels_line
from pretrain.trainer.log import get_logger, setup_logging
from pretrain.trainer.observe.goodput import GoodputLedger
from pretrain.trainer.observe.loggers import MetricsLogger
from pretrain.trainer.observe.metrics import PeakFlops, ThroughputMeter, resolve_peak_flops
from pretrain.trainer.observe.metrics_window import MetricsWindow
from pretrain.trainer.observe.run_identity import run_identity
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
    state.phases = StepPhases(rank.device)
    doc_eos = data.eos_id if cfg.data.doc_mask else None
    stepper, moe_pp_group = _stepper(cfg, state, degrees, mesh, rank, guard, doc_eos)
    training = train_loader(cfg, data, mesh.dp.get_local_rank(), degrees.dp)
    loader = _prefetching(cfg, training, rank)
    evaluator = _evaluator(cfg, data, mesh, degrees, rank, stepper, state)
    states = run_states(state, loader, run_dir, rank.is_main, guard.spikes)
    checkpointer = Checkpointer(
        run_dir, cfg.checkpoint, states, rank=rank.rank, world_size=rank.world_size, faults=faults
    )
    start, load_s = _restore(checkpointer, run_dir, rank)
    CLOCK.mark("loaders and checkpoint")
    if start:
        get_logger().info("resumed from the checkpoint of step %d", start)
    cache = Path(os.path.expanduser(cfg.data.cache_dir))
    peak = resolve_peak_flops(rank.device, peak_dtype(cfg.precision), cfg.hardware, cache)
    window = MetricsWindow(
        _throughput_meter(cfg, rank, peak),
        state=state,
        guard=guard,
        device=rank.device,
        dp_group=mesh.dp.get_group(),
        log_every=cfg.logging.log_every,
        straggler_lag=cfg.faults.straggler_lag,
        stage=mesh.world["pp"].get_local_rank() if degrees.pp > 1 else 0,
        moe_pp_group=moe_pp_group,
        data_metrics=lambda step: tokens_seen(
            training.sampler, data.labels, cfg.train.seq_len, step
        ),
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


def _evaluator(
    cfg: RecipeConfig,
    data: RunData,
    mesh: JobMesh,
    degrees: Degrees,
    rank: RankInfo,
    stepper: Stepper,
    state: TrainState,
) -> Evaluator:
    """The validation loss over this rank's share of the held-out split, when due."""
    return Evaluator(
        cfg.eval.every,
        cfg.eval.batches,
        stepper,
        val_loader(cfg, data, mesh.dp.get_local_rank(), degrees.dp),
        dp_group=mesh.dp.get_group(),
        model=state.plain,
        device=rank.device,
    )


def _prefetching(
    cfg: RecipeConfig, loader: DataLoader, rank: RankInfo
) -> DataLoader | PrefetchingLoader:
    """The loader, read ahead on a thread when data.prefetch asks (pinned on CUDA)."""
    if cfg.data.prefetch:
        pin = rank.device.type == "cuda"
        return PrefetchingLoader(loader, depth=cfg.data.prefetch, pin_memory=pin)
    return loader


def _throughput_meter(cfg: RecipeConfig, rank: RankInfo, peak: PeakFlops) -> ThroughputMeter:
    """MFU counts the model's FLOPs per token; HFU adds the recomputed forwards."""
    flops = flops_per_token(cfg.model, cfg.train.seq_len)
    blocks = recomputed_blocks(cfg.recompute, cfg.model.n_layers)
    return ThroughputMeter(
        tokens_per_step=cfg.train.global_batch * cfg.train.seq_len,
        model_flops_per_token=flops.train,
        hardware_flops_per_token=flops.with_recompute(
            cfg.recompute.policy, len(blocks) / cfg.model.n_layers
        ),
        devices=rank.world_size,
        peak=peak,
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
        "%s: %.2fM parameters%s, world %d (dp %d, zero %d, tp %d, pp %d%s, ep %d), "
        "grad accum %d, %s sequences%s; %s peak %s TFLOP/s (%s)",
        cfg.name,
        params.total / 1e6,
        active,
        rank.world_size,
        degrees.dp,
        cfg.parallel.zero,
        degrees.tp,
        degrees.pp,
        " with sp" if cfg.parallel.sp else "",
        degrees.ep,
        grad_accum_steps(cfg),
        "+".join(f"{len(s):,}" for s in data.train),
        f" ({sum(len(s) for s in data.val):,} for validation)" if data.val else "",
        peak.dtype,
        "n/a" if peak.tflops is None else f"{peak.tflops:.4g}",
        peak.source,
    )
    log.info("%s", kernels_line(cfg, state, rank.device))
    split = split_line(state.optimizer)
    if split:
        log.info("%s", split)
