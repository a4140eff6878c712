"""The optimizer's states as a checkpoint holds them: keyed by the plain model's parameter
names, in FP32 whatever dtype they are kept in (`trainer/optim/states.py`), so that any
layout loads them; ZeRO-1's sharded optimizer saves each rank's share.

A load fills the states only: the groups (which depend on the layout) and their
hyperparameters come from the recipe, and the lr from the restored schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from pretrain.parallel.data_parallel import is_zero1_optimizer
from pretrain.parallel.pipeline.tied_embedding import (
    EMBEDDING,
    HEAD,
    reads_copy_from_embedding,
    renamed,
)
from pretrain.trainer.optim.states import StoredStateOptimizer


def _names(plain: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in plain.named_parameters()}


def _zero1_optim_state(optimizer: torch.optim.Optimizer, plain: nn.Module) -> dict[str, Any]:
    """This rank's share of a ZeRO-1 optimizer, in the layout `get_state_dict` uses.

    Each rank holds the states of the parameters it owns; keyed by parameter name, the
    shares of all ranks are disjoint and together make the full optimizer state, which any
    layout can load (and a ZeRO-1 rank loads only the names it owns).
    """
    names = _names(plain)
    local = optimizer.optim
    stored = isinstance(local, StoredStateOptimizer)
    state = {
        # States kept in another dtype are saved in FP32 (trainer/optim/states.py).
        names[id(p)]: local.float_state(p) if stored else local.state[p]
        for group in local.param_groups
        for p in group["params"]
        if p in local.state
    }
    groups = []
    for global_group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
        hyper = {k: v for k, v in local_group.items() if k != "params"}
        hyper.update((k, v) for k, v in global_group.items() if k != "params")
        groups.append({**hyper, "params": [names[id(p)] for p in global_group["params"]]})
    return {"state": state, "param_groups": groups}


def _store_zero1_states(
    optimizer: torch.optim.Optimizer, plain: nn.Module, loaded: dict[str, Any]
) -> None:
    """Put loaded FP32 states back into an optimizer that keeps them in another dtype (the
    loaded tensors of the others are the live states, filled in place)."""
    local = optimizer.optim
    if not isinstance(local, StoredStateOptimizer):
        return
    names = _names(plain)
    for group in local.param_groups:
        for p in group["params"]:
            if names[id(p)] in loaded:
                local.load_float_state(p, loaded[names[id(p)]])


@torch.no_grad()
def _init_zero1_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate this rank's optimizer states (a step with zero gradients and lr 0) so that
    DCP has tensors to load into; the loaded values replace them."""
    local = optimizer.optim
    if local.state:
        return
    lrs = [group["lr"] for group in local.param_groups]
    for group in local.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    local.step()
    for group, lr in zip(local.param_groups, lrs, strict=True):
        group["lr"] = lr
    local.zero_grad(set_to_none=True)


class OptimizerState:
    """A Stateful over `optimizer` of the model `model()` returns (whose names are the full
    model's) and the plain model inside it, `plain()` (asked anew: PipeDream-2BW swaps
    them)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: Callable[[], nn.Module],
        plain: Callable[[], nn.Module],
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.plain = plain
        self._groups: list[dict[str, Any]] = []

    def _zero1(self) -> bool:
        return is_zero1_optimizer(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        if self._zero1():
            return _zero1_optim_state(self.optimizer, self.plain())
        return get_optimizer_state_dict(self.model(), self.optimizer)

    def state_dict_for_load(self) -> dict[str, Any]:
        """This rank's states (allocated if the optimizer has not stepped yet), for a load to
        fill; a stage's copy of a tied embedding reads the embedding's."""
        if self._zero1():
            _init_zero1_state(self.optimizer)
            # Only this rank's optimizer states: the shares of other ranks stay on disk.
            return {"state": _zero1_optim_state(self.optimizer, self.plain())["state"]}
        full = get_optimizer_state_dict(self.model(), self.optimizer)
        self._groups = full["param_groups"]
        state = full["state"]
        return {"state": renamed(state, HEAD, EMBEDDING) if self._reads_copy() else state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict_for_load` gave, filled."""
        if self._zero1():
            _store_zero1_states(self.optimizer, self.plain(), state_dict["state"])
            return
        state = state_dict["state"]
        state = renamed(state, EMBEDDING, HEAD) if self._reads_copy() else state
        full = {"state": state, "param_groups": self._groups}
        set_optimizer_state_dict(self.model(), self.optimizer, full)

    def _reads_copy(self) -> bool:
        return reads_copy_from_embedding(self.model())
