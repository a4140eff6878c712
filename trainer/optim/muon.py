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
parallelism (a DTensor) is gathered over the mesh dims that split its matrix dims
(trainer/optim/whole_matrices.py). Over data-parallel ranks the work is split
(`optim.distributed_muon`, trainer/optim/distributed_muon.py): each matrix is orthogonalized
by one rank, its owner, and the result sent to the others; without the split, or with one
data-parallel rank, every rank orthogonalizes every matrix it holds in full and keeps its own
slice. Newton-Schulz runs in FP32 (the master gradients' dtype), so every layout computes
what one process does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from pretrain.core.optim_states import NS_STEPS
from pretrain.trainer.optim.distributed_muon import Route, orthogonalize_routed
from pretrain.trainer.optim.states import StoredStateOptimizer, adamw_update, local_grad
from pretrain.trainer.optim.whole_matrices import gather_whole, keep_local, splits_matrices

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (and torch.optim.Muon)."""
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


def orthogonalized_local(
    param: torch.Tensor, update: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthogonalized update of `param`'s local shard, from the local shard `update`:
    whole matrices are gathered first where a mesh dim splits them."""
    if not splits_matrices(param):
        return orthogonalize(update, dtype)
    assert isinstance(param, DTensor)
    return keep_local(param, orthogonalize(gather_whole(param, update), dtype))


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
        self.routes = {}

    routes: dict[int, Route]
    """The parameters whose Newton-Schulz work is split over data-parallel ranks, by id (set
    by `split_work`; empty: every rank orthogonalizes every matrix it holds)."""

    def split_work(self, routes: dict[int, Route]) -> None:
        """Orthogonalize the parameters of `routes` by their owners (distributed Muon)."""
        self.routes = routes

    def _nesterov_update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the momentum of `param`'s local shard; the local update to orthogonalize."""
        mu = group["momentum"]
        grad = local_grad(param).float()
        buffer = self.stored(param, "momentum_buffer")
        momentum = buffer.get().lerp(grad, 1 - mu)
        buffer.set(momentum)
        return grad.lerp(momentum, mu)

    @staticmethod
    def _apply(param: torch.Tensor, group: dict[str, Any], update: torch.Tensor) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        local = param.to_local() if isinstance(param, DTensor) else param
        if wd:
            local.mul_(1 - lr * wd)
        local.add_(update.to(local.dtype), alpha=-muon_lr(lr, param.shape))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one update to every parameter that has a gradient (in group order, so every
        rank gathers and exchanges the same matrices in the same order)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        routed: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor]] = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not group["muon"]:
                    adamw_update(self, param, group)
                    continue
                update = self._nesterov_update(param, group)
                if id(param) in self.routes:
                    routed.append((param, group, update))
                else:
                    self._apply(param, group, orthogonalized_local(param, update, self.ns_dtype))
        pending = [(param, update, self.routes[id(param)]) for param, _, update in routed]
        results = orthogonalize_routed(pending, orthogonalize, self.ns_dtype)
        for (param, group, _), result in zip(routed, results, strict=True):
            self._apply(param, group, result)
        return loss
