"""ZeRO-1: optimizer states sharded over the ranks that hold the same parameters.

Every parameter has one owner among the ranks of its data-parallel group (whole parameters,
dealt out largest first to the rank owning the fewest elements, so the shares stay close).
The gradients are reduced before the step as under ZeRO-0 (DDP, FSDP2's `replicate`, or
parallel/expert.py for routed experts), so every rank holds every gradient; each rank then
steps only the parameters it owns with the recipe's optimizer, and each owner broadcasts
its updated parameters to its group: the arithmetic of ZeRO-0, with 1/dp of the states.

torch's ZeroRedundancyOptimizer partitions plain local tensors over one group. Here a
parameter may be a DTensor (tensor-parallel shards, FSDP2's replicated weights under a
pipeline) and may have a group of its own (routed experts are replicated over the ranks
that hold the same experts, not over dp), so ZeRO-1 composes with TP, SP, PP and EP: an
owner broadcasts its local shard, which every rank of its group holds alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pretrain.parallel.tensor import local_value


def deal_owners(sizes: list[int], ranks: int) -> list[int]:
    """The owner (an index among `ranks`) of each of parameters of `sizes` elements: the
    largest first, each to the rank owning the fewest elements so far (ties to the lowest
    index), so every rank computes the same answer from the same list."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """The recipe's optimizer over the parameters this rank owns (`optim`), and the
    broadcast that hands every rank the others' updates after each step.

    `param_groups` are the full groups, as the LR schedule, gradient clipping and the loss
    scaler see them; their hyperparameters are copied into `optim`'s before each step.
    `group_of(param)` is the process group over which that parameter is replicated.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        group_of: Callable[[nn.Parameter], dist.ProcessGroup],
    ) -> None:
        super().__init__(param_groups, dict(optimizer_kwargs))
        # Owners are dealt per process group, over the parameters of that group in model
        # order, and kept by position (group, index): PipeDream-2BW swaps the objects.
        members: dict[dist.ProcessGroup, list[tuple[int, int]]] = defaultdict(list)
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                members[group_of(param)].append((g, i))
        self._owner: dict[tuple[int, int], tuple[dist.ProcessGroup, int]] = {}
        for process_group, positions in members.items():
            sizes = [local_value(self.param_groups[g]["params"][i]).numel() for g, i in positions]
            owners = deal_owners(sizes, dist.get_world_size(process_group))
            for position, owner in zip(positions, owners, strict=True):
                global_owner = dist.get_global_rank(process_group, owner)
                self._owner[position] = (process_group, global_owner)
        me = dist.get_rank()
        owned = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [p for i, p in enumerate(group["params"]) if self._owner[g, i][1] == me],
            }
            for g, group in enumerate(self.param_groups)
        ]
        self.optim = optimizer_class(owned, **optimizer_kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned parameters with the full groups' hyperparameters, then hand every
        rank each owner's updated parameters."""
        for full, owned in zip(self.param_groups, self.optim.param_groups, strict=True):
            owned.update((k, v) for k, v in full.items() if k != "params")
        loss = self.optim.step(closure)
        self._broadcast_updates()
        return loss

    def _broadcast_updates(self) -> None:
        """One broadcast per owner, process group and dtype, of the owner's parameters
        flattened into one buffer."""
        buckets: dict[tuple[dist.ProcessGroup, int, torch.dtype], list[torch.Tensor]] = defaultdict(
            list
        )
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                process_group, owner = self._owner[g, i]
                local = local_value(param)
                buckets[process_group, owner, local.dtype].append(local)
        pending = []
        for (process_group, owner, _), tensors in buckets.items():
            if dist.get_world_size(process_group) == 1:
                continue
            flat = torch._utils._flatten_dense_tensors(tensors)
            work = dist.broadcast(flat, src=owner, group=process_group, async_op=True)
            pending.append((work, flat, tensors))
        for work, flat, tensors in pending:
            work.wait()
            for tensor, value in zip(
                tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True
            ):
                tensor.copy_(value)
