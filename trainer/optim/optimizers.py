"""Optimizers: parameter groups (which weights decay, which Muon updates), batch-size lr
scaling, AdamW/SGD/Lion/Muon, and optimizer states in `optim.state_dtype`.

Works on plain models and on models whose parameters are DTensors (FSDP2, tensor parallel):
decisions use module types and parameter names, never the shapes of local shards. AdamW with
FP32 states is torch's (fused on CUDA and CPU, foreach elsewhere); with other state dtypes, and Lion
and Muon always, the in-repo optimizers of trainer/optim/states.py and trainer/optim/muon.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from pretrain.core.problems import or_list
from pretrain.core.schema import LR_SCALINGS, OPTIMIZERS, OptimConfig
from pretrain.parallel.pipeline.tied_embedding import head_copies
from pretrain.trainer.optim.muon import Muon
from pretrain.trainer.optim.states import AdamW, StoredStateOptimizer, local_grad


def _mesh_of(param: torch.Tensor) -> Any:
    """The DeviceMesh of a DTensor parameter, None for a plain tensor."""
    return getattr(param, "device_mesh", None)


def param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[dict]:
    """Split the trainable parameters into optimizer groups; each parameter appears once.

    Weight decay goes to the 2-D+ weights of linear (and other matmul) layers only: never to
    embeddings (`nn.Embedding`, including an LM head tied to one, or a pipeline stage's copy
    of a tied embedding), norms or biases. With `muon`, those weights but the LM head (the
    model's `output`) form groups marked `muon: True`. Groups are further split by
    DeviceMesh so a group never mixes DTensors with plain tensors (the foreach/fused kernels
    reject such a mix, e.g. TP without sequence parallelism leaves the norms as plain
    tensors). Group order follows `named_parameters`, so it is stable across runs and
    checkpoints.
    """
    # Collect embedding weights first: a tied head is reached through a Linear too, and the
    # traversal may meet the head before the embedding.
    embedding_params = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    } | {id(p) for p in head_copies(model)}
    head = getattr(model, "output", None)
    head_params = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    groups: dict[tuple[bool, bool, Any], dict] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            # DTensor.ndim is the global (logical) rank, unchanged by sharding.
            decay = id(param) not in embedding_params and name != "bias" and param.ndim >= 2
            matrix = muon and decay and id(param) not in head_params
            key = (decay, matrix, _mesh_of(param))
            if key not in groups:
                groups[key] = {"params": [], "weight_decay": weight_decay if decay else 0.0}
                if muon:
                    groups[key]["muon"] = matrix
            groups[key]["params"].append(param)
    return list(groups.values())


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Peak lr for this global batch: lr * G/base (linear), lr * sqrt(G/base) (sqrt) or lr."""
    if cfg.lr_scaling == "none":
        return cfg.lr
    if cfg.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"optim.lr_scaling={cfg.lr_scaling!r}: use {or_list(list(LR_SCALINGS))}")
    if cfg.base_batch <= 0:
        raise ValueError(
            f"optim.lr_scaling={cfg.lr_scaling} needs optim.base_batch > 0 "
            "(the global batch the lr was tuned for)"
        )
    ratio = global_batch / cfg.base_batch
    return cfg.lr * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


class Lion(StoredStateOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step, with gradient g and momentum m:
        update = sign(beta1 * m + (1 - beta1) * g)
        p     <- p * (1 - lr * weight_decay) - lr * update      (decoupled weight decay)
        m     <- beta2 * m + (1 - beta2) * g
    Only elementwise ops, on each parameter's local shard; m is kept in `state_dtype`.
    """

    STATES: ClassVar[dict[str, bool]] = {"exp_avg": True}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        state_dtype: str = "fp32",
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lion: lr={lr} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas={betas} must lie in [0, 1)")
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults, state_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one Lion update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = local_grad(p)
                stored = self.stored(p, "exp_avg")
                exp_avg = stored.get()
                update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                local = p.to_local() if hasattr(p, "to_local") else p
                if wd != 0:
                    local.mul_(1 - lr * wd)
                local.add_(update, alpha=-lr)
                stored.set(exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2))
        return loss


def optimizer_spec(cfg: OptimConfig, device: torch.device) -> tuple[type[Optimizer], dict]:
    """The optimizer class and its keyword arguments (lr = the unscaled `cfg.lr`).

    AdamW with FP32 states uses torch's fused kernel on CUDA and CPU (on CPU one pass over
    each parameter: a quarter of the foreach path's time on the bench workload, the same
    update to rounding) and the foreach (multi-tensor) path elsewhere; other state dtypes
    the in-repo AdamW.
    """
    states = {"state_dtype": cfg.state_dtype}
    if cfg.name == "adamw" and cfg.state_dtype == "fp32":
        impl = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
        kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, **impl}
        return torch.optim.AdamW, kwargs
    if cfg.name == "adamw":
        return AdamW, {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, **states}
    if cfg.name == "sgd":
        if cfg.state_dtype != "fp32":
            raise ValueError(f"optim.state_dtype={cfg.state_dtype}: SGD keeps FP32 states")
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum, "foreach": True}
    if cfg.name == "lion":
        return Lion, {"lr": cfg.lr, "betas": tuple(cfg.betas), **states}
    if cfg.name == "muon":
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "betas": tuple(cfg.betas)}
        return Muon, {**kwargs, "eps": cfg.eps, **states}
    raise ValueError(f"optim.name={cfg.name!r}: use {or_list(list(OPTIMIZERS))}")


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, global_batch: int, device: torch.device
) -> Optimizer:
    """The optimizer over `param_groups(model)`; every group's lr is the batch-scaled peak.

    The LR scheduler multiplies that peak by the schedule's factor.
    """
    cls, kwargs = optimizer_spec(cfg, device)
    kwargs["lr"] = scaled_lr(cfg, global_batch)
    return cls(param_groups(model, cfg.weight_decay, muon=cfg.name == "muon"), **kwargs)
