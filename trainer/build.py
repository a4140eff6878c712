"""Build the parallelized, initialized model and its optimizer for one rank.

The order follows the design: plain model on meta -> tensor/sequence -> recompute -> FSDP ->
materialize and initialize (same weights for any layout) -> DDP; then the optimizer (ZeRO-1
sharded when asked) and the LR schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import models
from launcher.layout import Degrees
from launcher.schema import RecipeConfig
from parallel.data import apply_ddp, apply_fsdp, build_zero1_optimizer, uses_fsdp
from parallel.expert import apply_expert_parallel
from parallel.materialize import materialize
from parallel.mesh import JobMesh
from parallel.precision import LossScaler, apply_precision
from parallel.recompute import apply_recompute
from parallel.tensor import apply_tensor_parallel
from trainer.optim import build_optimizer, optimizer_spec, param_groups, scaled_lr
from trainer.schedule import build_lr_scheduler


@dataclass
class TrainState:
    """What the loop steps: the (wrapped) model, the plain model inside, and optimization."""

    model: nn.Module
    plain: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler


def parallelize(plain: nn.Module, cfg: RecipeConfig, mesh: JobMesh, degrees: Degrees) -> None:
    """Apply the layout to the plain meta-device model, in place, in the design's order:
    FP8 module swap -> pipeline split -> tensor/sequence -> expert -> recompute -> compile ->
    FSDP."""
    apply_precision(plain, cfg.precision)  # swaps modules, so before anything wraps them
    apply_tensor_parallel(plain, mesh, cfg.parallel)
    apply_expert_parallel(plain, mesh, cfg.parallel)
    apply_recompute(plain, cfg.recompute)
    if uses_fsdp(cfg.parallel, degrees):
        apply_fsdp(plain, mesh, degrees, cfg.parallel, cfg.precision)


def build_model(
    cfg: RecipeConfig, mesh: JobMesh, degrees: Degrees, device: torch.device
) -> tuple[nn.Module, nn.Module]:
    """The model wrapped for the layout, and the plain module it wraps."""
    plain = models.build(cfg.model)
    parallelize(plain, cfg, mesh, degrees)
    materialize(plain, cfg.model, cfg.seed, device)
    if degrees.dp > 1 and not uses_fsdp(cfg.parallel, degrees):
        return apply_ddp(plain, mesh), plain
    return plain, plain


def build_train_state(
    cfg: RecipeConfig, mesh: JobMesh, degrees: Degrees, device: torch.device
) -> TrainState:
    """Model, optimizer and LR schedule for this rank."""
    model, plain = build_model(cfg, mesh, degrees, device)
    if cfg.parallel.zero == 1 and degrees.dp_shard > 1:
        groups = param_groups(plain, cfg.optim.weight_decay)
        lr = scaled_lr(cfg.optim, cfg.train.global_batch)
        for group in groups:
            group["lr"] = lr
        optimizer_class, kwargs = optimizer_spec(cfg.optim, device)
        kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
        optimizer = build_zero1_optimizer(groups, optimizer_class, kwargs, mesh)
    else:
        optimizer = build_optimizer(
            plain, cfg.optim, global_batch=cfg.train.global_batch, device=device
        )
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.schedule, cfg.train.steps)
    return TrainState(
        model=model,
        plain=plain,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=LossScaler(cfg.precision),
    )
