"""Build the parallelized, initialized model and its optimizer for one rank.

The order follows the design: plain model on meta -> pipeline split (this rank's stages) ->
tensor/sequence -> context -> recompute -> compile -> FSDP -> materialize and initialize
(same weights for any layout) -> DDP; then the optimizer (ZeRO-1 sharded when asked), the
LR schedule and the (compiled, optionally chunked) loss. Muon's Newton-Schulz work is split
over the data-parallel ranks (distributed Muon) unless ZeRO-1 already gives each rank its
own matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain import models
from pretrain.core.data_order.ramps import Ramp
from pretrain.core.layout import expert_node_groups, uses_fsdp
from pretrain.core.schedules import SCHEDULES, splits_backward
from pretrain.core.schema import RecipeConfig
from pretrain.models.moe import set_node_groups
from pretrain.parallel.compile import apply_compile, compile_loss
from pretrain.parallel.context import apply_context_parallel, context_split
from pretrain.parallel.data_parallel import (
    apply_ddp,
    apply_fsdp,
    apply_replicate,
    build_zero1_optimizer,
    replicates_with_fsdp,
)
from pretrain.parallel.expert import apply_expert_parallel
from pretrain.parallel.materialize import materialize
from pretrain.parallel.mesh import JobMesh
from pretrain.parallel.pipeline.stages import StageView, split_stage, stage_indices
from pretrain.parallel.pipeline.tied_embedding import mark_head_copy
from pretrain.parallel.precision import LossScaler, apply_precision
from pretrain.parallel.recompute import apply_recompute
from pretrain.parallel.tensor import apply_tensor_parallel
from pretrain.parallel.zero.offload import optimizer_device_type
from pretrain.trainer.optim.distributed_muon import muon_routes
from pretrain.trainer.optim.lr_schedule import build_lr_scheduler
from pretrain.trainer.optim.muon import Muon
from pretrain.trainer.optim.optimizers import (
    build_optimizer,
    optimizer_spec,
    param_groups,
    scaled_lr,
)
from pretrain.trainer.step.chunked_loss import ChunkedLMLoss
from pretrain.trainer.step.mtp_loss import MultiTokenLoss, lm_loss_sum
from pretrain.trainer.step.state import TrainState, lm_loss


def parallelize(plain: nn.Module, cfg: RecipeConfig, mesh: JobMesh) -> None:
    """Apply the layout to the plain meta-device model, in place, in the design's order:
    FP8 module swap -> pipeline split -> tensor/sequence -> context -> expert -> recompute ->
    compile -> FSDP (or, for ZeRO-0 under TP or PP, FSDP2's replicate)."""
    apply_precision(plain, cfg.precision)  # swaps modules, so before anything wraps them
    apply_tensor_parallel(plain, mesh, cfg.parallel)
    apply_context_parallel(plain, mesh)
    apply_expert_parallel(plain, mesh)
    apply_recompute(plain, cfg.recompute)
    split = splits_backward(mesh.degrees.pp, cfg.parallel.pp_schedule)
    apply_compile(plain, cfg.compile, mesh.degrees.cp > 1, split)
    if uses_fsdp(cfg.parallel, mesh.degrees):
        apply_fsdp(plain, mesh, cfg.parallel, cfg.precision)
    elif replicates_with_fsdp(cfg.parallel, mesh.degrees):
        apply_replicate(plain, mesh, cfg.precision)


def build_model(
    cfg: RecipeConfig, mesh: JobMesh, device: torch.device
) -> tuple[nn.Module, nn.Module]:
    """The model wrapped for the layout, and the plain module it wraps.

    With pp > 1: a ModuleList of this rank's wrapped stage chunks, and a `StageView` of
    them that carries the full model's parameter names.
    """
    if mesh.degrees.pp > 1:
        pp_rank = mesh.world["pp"].get_local_rank()
        built = [
            _build_one(cfg, mesh, device, stage) for stage in stage_indices(pp_rank, cfg.parallel)
        ]
        return nn.ModuleList(m for m, _ in built), StageView([p for _, p in built])
    return _build_one(cfg, mesh, device)


def _build_one(
    cfg: RecipeConfig, mesh: JobMesh, device: torch.device, stage: int = -1
) -> tuple[nn.Module, nn.Module]:
    plain = models.build(cfg.model)
    set_node_groups(plain, expert_node_groups(cfg))
    if stage >= 0:
        split_stage(plain, stage, cfg.parallel)
    parallelize(plain, cfg, mesh)
    mark_head_copy(plain)
    plain.head_in_loss = _head_in_loss(cfg, plain)
    host = torch.device(optimizer_device_type(cfg.parallel, device.type))
    materialize(plain, cfg.model, cfg.seed, device, param_device=host)
    replicated = uses_fsdp(cfg.parallel, mesh.degrees) or replicates_with_fsdp(
        cfg.parallel, mesh.degrees
    )
    if mesh.degrees.grad_replicas > 1 and not replicated:
        return apply_ddp(plain, mesh, cfg.parallel, cfg.precision), plain
    return plain, plain


def _head_in_loss(cfg: RecipeConfig, plain: nn.Module) -> bool:
    """Whether the loss computes the LM head, in `train.loss_chunks` chunks: only where the
    model (or this rank's last pipeline stage) holds the head."""
    return cfg.train.loss_chunks > 1 and getattr(plain, "output", None) is not None


def build_train_state(cfg: RecipeConfig, mesh: JobMesh, device: torch.device) -> TrainState:
    """Model, optimizer and LR schedule for this rank (and, under PipeDream-2BW, the second
    weight version, built alike: the same initial weights)."""
    degrees = mesh.degrees
    model, plain = build_model(cfg, mesh, device)
    two_versions = degrees.pp > 1 and SCHEDULES[cfg.parallel.pp_schedule].weight_versions > 1
    stash = build_model(cfg, mesh, device)[1] if two_versions else None
    if cfg.parallel.zero == 1 and degrees.dp_shard > 1:
        groups = param_groups(plain, cfg.optim.weight_decay, muon=cfg.optim.name == "muon")
        lr = scaled_lr(cfg.optim, cfg.train.global_batch)
        for group in groups:
            group["lr"] = lr
        optimizer_class, kwargs = optimizer_spec(cfg.optim, device)
        kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
        optimizer = build_zero1_optimizer(groups, optimizer_class, kwargs, mesh, plain)
    else:
        optimizer = build_optimizer(
            plain,
            cfg.optim,
            global_batch=cfg.train.global_batch,
            device=torch.device(optimizer_device_type(cfg.parallel, device.type)),
        )
    if isinstance(optimizer, Muon) and cfg.optim.distributed_muon and degrees.grad_replicas > 1:
        matrices = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
        optimizer.split_work(muon_routes(plain, mesh, matrices))
    scheduler = build_lr_scheduler(
        optimizer, cfg.optim, cfg.schedule, cfg.train.steps, Ramp(cfg.train)
    )
    # The vocab-parallel loss works on DTensor logits under loss_parallel: left eager.
    loss_fn = compile_loss(lm_loss, cfg.compile) if degrees.tp == 1 else lm_loss
    eval_fn = lm_loss
    chunked: tuple[ChunkedLMLoss, ...] = ()
    head = getattr(plain, "output", None)
    if head is not None and _head_in_loss(cfg, plain):
        chunked = (
            ChunkedLMLoss(head, cfg.train.loss_chunks, loss_fn),
            ChunkedLMLoss(head, cfg.train.loss_chunks, lm_loss),
        )
        loss_fn, eval_fn = chunked
    mtp = None
    if cfg.model.mtp_layers:
        ahead = compile_loss(lm_loss_sum, cfg.compile) if degrees.tp == 1 else lm_loss_sum
        if chunked:
            ahead = ChunkedLMLoss(chunked[0].head, cfg.train.loss_chunks, ahead, sums=True)
        pp = mesh.world["pp"].get_group() if degrees.pp > 1 else None
        weight = cfg.model.mtp_loss_weight
        mtp = MultiTokenLoss(loss_fn, ahead, cfg.model.mtp_layers, weight, pp)
        loss_fn = mtp
    return TrainState(
        model=model,
        plain=plain,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=LossScaler(cfg.precision),
        # Every dp and cp rank routes tokens of its own: the biases follow all their loads.
        routing_group=mesh.dp_cp.get_group() if degrees.dp * degrees.cp > 1 else None,
        loss_fn=loss_fn,
        eval_loss_fn=eval_fn,
        chunked_losses=chunked,
        context=context_split(mesh),
        stash=stash,
        mtp=mtp,
    )
