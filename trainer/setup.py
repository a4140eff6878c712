"""Everything a rank builds before its first step, in one place, so the loop only steps.

Mesh, model and optimizer (`trainer.build`), the step of the layout (plain or pipelined),
the data loader, the checkpointer (restored from the newest checkpoint), the fault guard
and injector, the metrics window and the metrics sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from models.flops import count_params, flops_per_token
from parallel.mesh import JobMesh, build_mesh
from pretrain_core.layout import Degrees, grad_accum_steps, resolve_degrees
from pretrain_core.precision import peak_dtype
from pretrain_core.recompute import recomputed_blocks
from pretrain_core.schema import RecipeConfig
from trainer.build import build_train_state
from trainer.checkpoint import Checkpointer
from trainer.data import DataLoader, GlobalBatchSampler, prepare_dataset
from trainer.dist import RankInfo
from trainer.fault_injection import FaultInjector
from trainer.faults import StepGuard, clear_preempted
from trainer.kernels import kernels_line
from trainer.log import get_logger, setup_logging
from trainer.loggers import MetricsLogger
from trainer.metrics import PeakFlops, ThroughputMeter, resolve_peak_flops
from trainer.metrics_window import MetricsWindow
from trainer.pipeline_step import pipeline_step
from trainer.prefetch import PrefetchingLoader
from trainer.step import LocalStep, Stepper, TrainState


@dataclass
class Run:
    """One rank's run, ready for its first step."""

    cfg: RecipeConfig
    rank: RankInfo
    run_dir: Path
    state: TrainState
    stepper: Stepper
    loader: DataLoader | PrefetchingLoader
    checkpointer: Checkpointer
    guard: StepGuard
    faults: FaultInjector
    window: MetricsWindow
    metrics: MetricsLogger
    start: int
    """Steps already done (restored from a checkpoint); 0 for a fresh run."""


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
    run_dir = Path(cfg.run.dir)
    faults = FaultInjector.from_env(rank.rank)
    guard = StepGuard(cfg.faults.max_bad_steps, rank.device)
    state = build_train_state(cfg, mesh, degrees, rank.device)
    state.loss_fn = faults.poisoned(state.loss_fn)
    stepper: Stepper
    moe_pp_group = None
    if degrees.pp > 1:
        stepper = pipeline_step(state, cfg, degrees, mesh, rank.device, guard)
        moe_pp_group = stepper.group if cfg.model.moe_experts else None
    else:
        stepper = LocalStep(state, cfg, degrees, rank.device, guard)
    loader, sequences = _data_loader(cfg, mesh, degrees, rank)
    checkpointer = Checkpointer(
        run_dir, cfg.checkpoint, rank=rank.rank, world_size=rank.world_size, faults=faults
    )
    start = checkpointer.restore(state, loader)
    if rank.is_main:
        clear_preempted(run_dir)
    if start:
        get_logger().info("resumed from the checkpoint of step %d", start)
    peak = resolve_peak_flops(rank.device, peak_dtype(cfg.precision), cfg.hardware)
    window = MetricsWindow(
        _throughput_meter(cfg, rank, peak),
        state=state,
        guard=guard,
        device=rank.device,
        dp_group=mesh.dp.get_group(),
        log_every=cfg.logging.log_every,
        straggler_lag=cfg.faults.straggler_lag,
        moe_pp_group=moe_pp_group,
    )
    metrics = MetricsLogger(
        run_dir,
        is_main=rank.is_main,
        logging=cfg.logging,
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        run_name=cfg.name,
        total_steps=cfg.train.steps,
    )
    _announce(cfg, rank, degrees, state, sequences, peak)
    return Run(
        cfg, rank, run_dir, state, stepper, loader, checkpointer, guard, faults, window, metrics,
        start,
    )  # fmt: skip


def _data_loader(
    cfg: RecipeConfig, mesh: JobMesh, degrees: Degrees, rank: RankInfo
) -> tuple[DataLoader | PrefetchingLoader, int]:
    """This rank's share of every global batch, in the same order under any layout, and the
    number of sequences the dataset holds."""
    dataset = prepare_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    sampler = GlobalBatchSampler(len(dataset), cfg.train.global_batch, cfg.seed)
    dp_rank = mesh.dp.get_local_rank()
    loader = DataLoader(
        dataset, sampler, dp_rank=dp_rank, dp_size=degrees.dp, micro_batch=cfg.train.micro_batch
    )
    if cfg.data.prefetch:
        pin = rank.device.type == "cuda"
        return PrefetchingLoader(loader, depth=cfg.data.prefetch, pin_memory=pin), len(dataset)
    return loader, len(dataset)


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
    sequences: int,
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
        "grad accum %d, %d sequences; %s peak %s TFLOP/s (%s)",
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
        sequences,
        peak.dtype,
        peak.tflops,
        peak.source,
    )
    log.info("%s", kernels_line(cfg, state, rank.device))
