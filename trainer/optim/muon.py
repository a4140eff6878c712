"""Muon (Jordan et al. 2024) for the hidden weight matrices, AdamW for everything else.

Per step, for a weight matrix W of shape A x B with gradient G (Nesterov momentum, as
`torch.optim.Muon`):

    M <- mu M + (1 - mu) G;   U = (1 - mu) G + mu M
    O = NewtonSchulz5(U)             (about U V^T of U's SVD: an orthogonalized update)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

The 0.2 sqrt(max(A, B)) factor gives the update the RMS of AdamW's (Moonlight, Liu et al.
2025), so the recipe's AdamW lr and weight decay carry over. The authors' split: Muon for
the blocks' 2-D weights (attention and MLP projections, the router, each expert's matrices
of a stacked [N, A, B] tensor), AdamW for embeddings, the LM head, norms and biases.

The orthogonalization needs whole matrices. A parameter sharded by FSDP2 or tensor
parallelism (a DTensor) is gathered over the mesh dims that split its matrix dims, every
rank orthogonalizes the same full matrix and keeps its own slice (no second collective);
dims that only split a stack of experts (expert parallelism) stay sharded, since each rank
holds whole expert matrices. Newton-Schulz runs in FP32 (the master gradients' dtype), so
every layout computes what one process does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from pretrain.trainer.optim.states import StoredStateOptimizer, adamw_update, local_grad

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (and torch.optim.Muon)."""
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(update: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz orthogonalization of each matrix in `update` [..., A, B], computed in
    `dtype` (torch.optim.Muon's iteration: the same operations in the same order)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    batched = x.ndim > 2
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        if batched:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        else:
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    return x.mT if tall else x


def _batch_shard(placement: Any, ndim: int) -> bool:
    # A plain shard of a dim before the matrix dims (experts of a stacked tensor).
    return type(placement) is Shard and placement.dim < ndim - 2


def orthogonalized_local(
    param: torch.Tensor, update: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthogonalized update of `param`'s local shard, from the local shard `update`:
    whole matrices are gathered first where a mesh dim splits them."""
    if not isinstance(param, DTensor):
        return orthogonalize(update, dtype)
    mesh, placements, ndim = param.device_mesh, param.placements, param.ndim
    if all(p.is_replicate() or _batch_shard(p, ndim) for p in placements):
        return orthogonalize(update, dtype)
    whole = DTensor.from_local(
        update, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    if not any(_batch_shard(p, ndim) for p in placements):
        full = orthogonalize(whole.full_tensor(), dtype)
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    keep = [p if _batch_shard(p, ndim) else Replicate() for p in placements]
    result = orthogonalize(whole.redistribute(mesh, keep).to_local(), dtype)
    gathered = DTensor.from_local(
        result, mesh, keep, run_check=False, shape=param.shape, stride=param.stride()
    )
    # Replicate -> Shard keeps a local slice: no communication.
    return gathered.redistribute(mesh, placements).to_local()


def muon_lr(lr: float, shape: torch.Size) -> float:
    """The lr of a matrix of `shape` (its last two dims): AdamW's RMS-matched scaling."""
    return lr * 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class Muon(StoredStateOptimizer):
    """Muon on groups marked `muon: True`, AdamW on the others (see the module doc); states
    in `state_dtype`."""

    STATES: ClassVar[dict[str, bool]] = {
        "momentum_buffer": True,
        "exp_avg": True,
        "exp_avg_sq": False,
    }
    ns_dtype = torch.float32
    """Dtype of the Newton-Schulz iteration (torch.optim.Muon's is bf16)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        state_dtype: str = "fp32",
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "muon": False,
        }
        super().__init__(params, defaults, state_dtype)

    @torch.no_grad()
    def _muon_update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        grad = local_grad(param).float()
        buffer = self.stored(param, "momentum_buffer")
        momentum = buffer.get().lerp(grad, 1 - mu)
        buffer.set(momentum)
        update = orthogonalized_local(param, grad.lerp(momentum, mu), self.ns_dtype)
        local = param.to_local() if isinstance(param, DTensor) else param
        if wd:
            local.mul_(1 - lr * wd)
        local.add_(update.to(local.dtype), alpha=-muon_lr(lr, param.shape))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one update to every parameter that has a gradient (in group order, so every
        rank gathers the same matrices in the same order)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["muon"]:
                    self._muon_update(param, group)
                else:
                    adamw_update(self, param, group)
        return loss
