"""The per-rank training program: set up from the frozen config, then step and log."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from models.flops import count_params, flops_per_token
from parallel.mesh import build_mesh
from parallel.recompute import recomputed_blocks
from pretrain_core.layout import grad_accum_steps, resolve_degrees
from pretrain_core.precision import peak_dtype
from pretrain_core.schema import RecipeConfig, load_config
from trainer.build import build_train_state
from trainer.checkpoint import Checkpointer
from trainer.data import DataLoader, GlobalBatchSampler, prepare_dataset
from trainer.dist import RankInfo, init_distributed
from trainer.faults import (
    StepGuard,
    clear_preempted,
    gather_step_times,
    inject_rank_faults,
    mark_preempted,
    nan_steps,
    slowest_rank,
)
from trainer.kernels import kernels_line
from trainer.loggers import MetricsLogger
from trainer.metrics import ThroughputMeter, peak_memory_gib, resolve_peak_flops
from trainer.moe_metrics import expert_load_metrics
from trainer.prefetch import PrefetchingLoader
from trainer.step import train_step


def _hfu_flops_per_token(cfg: RecipeConfig) -> int:
    flops = flops_per_token(cfg.model, cfg.train.seq_len)
    blocks = recomputed_blocks(cfg.recompute, cfg.model.n_layers)
    return flops.with_recompute(cfg.recompute.policy, len(blocks) / cfg.model.n_layers)


def run(cfg: RecipeConfig, rank: RankInfo) -> None:
    """Train `cfg` on this rank until `train.steps`."""
    degrees = resolve_degrees(cfg)
    if degrees.world != rank.world_size:
        raise RuntimeError(
            f"the recipe's layout needs {degrees.world} ranks but torchrun started "
            f"{rank.world_size}; launch it with `pretrain` or fix cluster.gpus_per_node"
        )
    torch.manual_seed(cfg.seed)
    mesh = build_mesh(degrees, rank.device.type)
    dp_rank = mesh.dp.get_local_rank()
    dp_group = mesh.dp.get_group()
    run_dir = Path(cfg.run.dir)

    state = build_train_state(cfg, mesh, degrees, rank.device)
    pipeline = None
    if degrees.pp > 1:
        from trainer.pipeline_step import pipeline_step

        pipeline = pipeline_step(state, cfg, degrees, mesh, rank.device)
    moe_pp_group = pipeline.group if pipeline is not None and cfg.model.moe_experts else None
    dataset = prepare_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len)
    sampler = GlobalBatchSampler(len(dataset), cfg.train.global_batch, cfg.seed)
    loader = DataLoader(
        dataset, sampler, dp_rank=dp_rank, dp_size=degrees.dp, micro_batch=cfg.train.micro_batch
    )
    if cfg.data.prefetch:
        loader = PrefetchingLoader(
            loader, depth=cfg.data.prefetch, pin_memory=rank.device.type == "cuda"
        )

    checkpointer = Checkpointer(run_dir, cfg.checkpoint, rank=rank.rank, world_size=rank.world_size)
    start = checkpointer.restore(state, loader)
    guard = StepGuard(cfg.faults.max_bad_steps, rank.device)
    poisoned = nan_steps()
    if rank.is_main:
        clear_preempted(run_dir)
        if start:
            print(f"[trainer] resumed from the checkpoint of step {start}", flush=True)

    model_flops = flops_per_token(cfg.model, cfg.train.seq_len).train
    peak = resolve_peak_flops(rank.device, peak_dtype(cfg.precision), cfg.hardware)
    meter = ThroughputMeter(
        tokens_per_step=cfg.train.global_batch * cfg.train.seq_len,
        model_flops_per_token=model_flops,
        hardware_flops_per_token=_hfu_flops_per_token(cfg),
        devices=rank.world_size,
        peak=peak,
    )
    from omegaconf import OmegaConf

    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    with MetricsLogger(
        run_dir,
        is_main=rank.is_main,
        logging=cfg.logging,
        config=config_dict,
        run_name=cfg.name,
        total_steps=cfg.train.steps,
    ) as logger:
        if rank.is_main:
            params = count_params(cfg.model)
            active = f" ({params.active / 1e6:.2f}M active)" if params.moe_layers else ""
            print(
                f"[trainer] {cfg.name}: {params.total / 1e6:.2f}M parameters{active}, "
                f"world {rank.world_size} "
                f"(dp {degrees.dp}, zero {cfg.parallel.zero}, tp {degrees.tp}, pp {degrees.pp}"
                f"{' with sp' if cfg.parallel.sp else ''}, ep {degrees.ep}), "
                f"grad accum {grad_accum_steps(cfg)}, {len(dataset)} sequences; "
                f"{peak.dtype} peak {peak.tflops} TFLOP/s ({peak.source})",
                flush=True,
            )
            print(kernels_line(cfg, state, rank.device), flush=True)
        window_start = time.perf_counter()
        window_data_wait = 0.0
        window_steps = 0
        saved = start
        for step in range(start, cfg.train.steps):
            wait_start = time.perf_counter()
            micro_batches = loader.next_step()
            window_data_wait += time.perf_counter() - wait_start
            lr = state.scheduler.get_last_lr()[0]
            if pipeline is not None:
                loss, norm, bad, stop = pipeline.step(micro_batches, guard)
            else:
                poison = rank.is_main and step + 1 in poisoned
                loss, norm, bad, stop = train_step(
                    state, micro_batches, cfg, degrees, rank.device, guard, poison
                )
            guard.record(step + 1, bad)
            inject_rank_faults(rank.rank, step + 1)
            window_steps += 1
            checkpointer.poll()
            if checkpointer.due(step + 1) or stop:
                checkpointer.save(step + 1, state, loader)
                saved = step + 1
            last = step == cfg.train.steps - 1
            if (step + 1) % cfg.logging.log_every and not last and not stop:
                continue
            dist.all_reduce(loss, group=dp_group)
            loss_value = loss.item() / degrees.dp
            elapsed = time.perf_counter() - window_start
            _report_straggler(cfg, rank, step + 1, elapsed / window_steps)
            metrics = {
                # Non-finite values are written as null: metrics.jsonl stays strict JSON.
                "loss": loss_value if math.isfinite(loss_value) else None,
                "lr": lr,
                # An overflowed fp16 step has no norm; None keeps metrics.jsonl strict JSON.
                "grad_norm": norm.item() if torch.isfinite(norm) else None,
                **meter.measure(
                    steps=window_steps, elapsed_s=elapsed, data_wait_s=window_data_wait
                ),
                "mem_peak_gib": peak_memory_gib(rank.device),
                **state.scaler.metrics(),
                "skipped_steps": guard.skipped + state.scaler.skipped_steps,
                **expert_load_metrics(state.plain, dp_group, window_steps, moe_pp_group),
            }
            logger.log(step + 1, metrics)
            window_start, window_data_wait, window_steps = time.perf_counter(), 0.0, 0
            if stop:
                checkpointer.wait()
                if rank.is_main:
                    mark_preempted(run_dir, step + 1)
                    print(f"[trainer] stopped by a signal after step {step + 1}; saved", flush=True)
                return
        if saved != cfg.train.steps:
            checkpointer.save(cfg.train.steps, state, loader)
        checkpointer.wait()


def _report_straggler(cfg: RecipeConfig, rank: RankInfo, step: int, mean_step_s: float) -> None:
    """Name the slowest rank when it lags the median step time by more than the threshold."""
    times = gather_step_times(mean_step_s, rank.device)
    slow = slowest_rank(times, cfg.faults.straggler_lag)
    if rank.is_main and slow is not None:
        print(
            f"[trainer] step {step}: rank {slow[0]} is a straggler: {times[slow[0]]:.3f} s/step, "
            f"{100 * slow[1]:.0f}% over the median",
            flush=True,
        )


def main(config_path: str) -> None:
    """Run one rank of the job described by the run dir's config.yaml."""
    cfg = load_config(config_path)
    rank = init_distributed(cfg.cluster, cfg.faults.collective_timeout_s)
    try:
        run(cfg, rank)
        # No rank tears down its connections while a peer still has work in flight.
        dist.barrier()
    finally:
        dist.destroy_process_group()
