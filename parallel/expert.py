"""Expert parallelism: the routed experts sharded over an EP group carved from data parallelism.

The EP group: the flattened data-parallel index (dp_replicate x dp_shard) splits into
(dp / ep, ep), ep inner, exactly as `pretrain.core.layout.rank_groups` lists the "ep" groups. A
second DeviceMesh (pp, edp, ep, tp) over the same ranks names both halves: `ep` (the ranks
that share one set of tokens' experts) and `edp` (the ranks that hold the same experts:
dp / ep of them times cp, since the cp ranks of a sequence hold the same weights and each
dispatches its own chunks within the ep group of its cp index).

- Parameters: each MoE layer's stacked expert weights become DTensors sharded on dim 0 over
  `ep`, so rank i holds experts [i*N/ep, (i+1)*N/ep). Initialization draws the full stacked
  tensor by name and slices it (parallel/materialize.py), gradient clipping sums their norms
  over `ep` (parallel/clip.py), both through DTensor.
- Dispatch, per MoE layer and micro-batch, with static shapes and no host sync: each rank
  sends every expert a slot of R rows (its kept assignments, then zero rows) with one even
  `all_to_all_single` (the functional autograd form, so the backward sends the gradients
  home); the experts run their ep slots as one group each (zero rows add nothing) and the
  outputs travel back the same way. With a capacity, R = sequences x per-sequence capacity,
  which no expert can exceed. Dropless, R follows the largest load seen so far with 25%
  headroom (`SlotBound`); a load above it is found once per step (`settle_slot_bounds`, the
  step's one host sync), R grows and the step runs again, so results are always dropless.
- Gradients: expert weights see the tokens of the whole EP group, so their gradients are
  summed over `edp` and divided by dp x cp, matching the mean the data-parallel wrappers take
  of every other gradient (over `JobMesh.dp_cp`). Under DDP and ZeRO-1 they are left out of
  the wrapper and all-reduced here once per step (`reduce_expert_grads`); under ZeRO-2/3
  FSDP2 shards each layer's experts over `edp` too (parallel/data_parallel.py), so they are
  sharded by ep x edp (with edp = 1 there is nothing to shard and they are reduced here, as
  under DDP).
- Tensor parallelism: a MoE layer is not split over tp (`parallel/tensor.py` hands it the
  full sequence, replicated): every TP rank routes the same tokens and dispatches within its
  own EP group, which holds the ranks of the same tp index.
- Expert tensor parallelism (`parallel.etp`, dividing tp): each expert's matrices are split
  over etp consecutive ranks of the tp group, w1 and w3 [N, f, h] by column (dim 1), w2
  [N, h, f] by row (dim 2), as DTensors over (ep, etp). A rank's experts then output partial
  sums: the MoE block sums its combined routed output over etp (one all-reduce of tokens x h
  per layer and forward), and in backward the gradients of the tokens and the routing weights
  that fed the experts (`ExpertSlices`). The tp / etp ranks holding the same slices compute
  the same thing, as the tp ranks do at etp = 1; they are no gradient replicas (`edp` is
  unchanged). The dispatch runs within the ep group of the rank's tp index, so each etp rank
  exchanges whole token rows with the ranks holding the same slice of the other experts.
- Balancing bias (`model.moe_balance=bias|both`): after each optimizer step the step's loads
  are summed over dp x cp and every rank nudges its layers' biases alike (`finish_routing_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import ParallelConfig
from pretrain.models.moe import (
    Grouped,
    GroupedExperts,
    MoEFeedForward,
    WholeExperts,
    moe_modules,
    router_losses,
)
from pretrain.parallel.mesh import JobMesh

SLOT_HEADROOM = 1.25
"""Dropless slots hold the largest load seen times this."""
SLOT_START = 2.0
"""Dropless slots start at this multiple of the mean load per expert."""
SLOT_ALIGN = 8
"""Slot rows are rounded up to a multiple of this (aligned grouped-GEMM groups)."""
ETP_DIMS = {"w1": 1, "w3": 1, "w2": 2}
"""The dim of each stacked expert weight that expert tensor parallelism splits: the experts'
hidden width f, by column in w1 and w3 [N, f, h], by row in w2 [N, h, f]."""
WIDTH_DIMS = {"w1": 2, "w3": 2, "w2": 1}
"""The dim of each stacked expert weight that is the model width h, which neither ep (dim 0)
nor etp splits: where ZeRO-2/3 shard the experts."""


@dataclass
class ExpertReplicas:
    """Where an EP-sharded expert module's copies live: the `edp` ranks holding the same
    experts, the dp size its gradients are averaged over, and whether FSDP2 reduces them."""

    mesh: DeviceMesh
    dp: int
    fsdp: bool = False


class SlotBound:
    """The dropless slot size of one MoE layer: rows per (source rank, expert), learned."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.factor = SLOT_START
        self.used = 0
        self.mean = 1.0
        self.seen: torch.Tensor | None = None

    def rows(self, assignments: int, experts: int) -> int:
        """Slot rows for a forward of `assignments` rows over `experts` experts."""
        self.mean = assignments / experts
        rows = math.ceil(self.factor * self.mean / SLOT_ALIGN) * SLOT_ALIGN
        self.used = min(rows, assignments)
        return self.used

    def observe(self, largest: torch.Tensor) -> None:
        """Remember the largest slot this forward needed (on the device: no sync).

        The same one op whether or not an earlier forward was seen: a block under selective
        recompute must issue in its recomputation the ops its forward did."""
        self.seen = torch.maximum(largest if self.seen is None else self.seen, largest)

    def settle(self, largest: int) -> bool:
        """Adapt to the step's largest load over all ranks; True when a slot overflowed."""
        self.seen = None
        if not self.used:
            return False
        overflowed = largest > self.used
        needed = largest / self.mean * SLOT_HEADROOM
        if overflowed or needed < self.factor / 2:
            self.factor = needed
        return overflowed


class AllToAllDispatch:
    """Runs the rows grouped by (global) expert on the experts' ranks of the EP group."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh, layer: int) -> None:
        self.experts = experts
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.bound = SlotBound(layer)

    def __call__(self, grouped: Grouped) -> torch.Tensor:
        rows, counts = grouped.rows, grouped.counts
        total, h = rows.shape
        n = counts.numel()
        local, ep = n // self.ep, self.ep
        if grouped.slot_rows is None:
            slot = self.bound.rows(total, n)
            self.bound.observe(counts.max())
        else:
            slot = grouped.slot_rows
        device = rows.device
        starts = counts.cumsum(0) - counts
        place = torch.arange(slot, device=device)
        # Slot (e, j) takes the expert's j-th kept row, or the zero row appended at `total`.
        source = torch.where(place < counts[:, None], starts[:, None] + place, total)
        padded = torch.cat([rows, rows.new_zeros(1, h)])[source.flatten()]
        received = all_to_all_single_autograd(padded, None, None, self.group)
        # Arrived as (source rank, local expert, slot); the experts want (expert, source rank).
        by_expert = received.view(ep, local, slot, h).transpose(0, 1).reshape(-1, h)
        group_rows = ep * slot
        ends = torch.arange(1, local + 1, device=device) * group_rows
        out = self.experts(by_expert, ends, [group_rows] * local)
        back = out.view(local, ep, slot, h).transpose(0, 1).reshape(-1, h)
        returned = all_to_all_single_autograd(back, None, None, self.group)
        # Each kept row's output is at (expert, its place among the expert's rows).
        experts = grouped.experts.clamp(max=n - 1)
        offset = torch.arange(total, device=device) - starts.gather(0, experts)
        kept = (grouped.experts < n) & (offset < slot)
        index = torch.where(kept, experts * slot + offset, n * slot)
        return torch.cat([returned, returned.new_zeros(1, h)])[index]


class _SumOverGroup(torch.autograd.Function):
    """An all-reduce (sum) over `group` in forward and the identity in backward, or the
    other way round (`in_forward=False`): the pair that joins ranks computing parts of one
    replicated value, whose loss every rank computes alike. Functional collectives, so that
    compiled and recomputed blocks trace them (a DTensor round trip would save its mesh
    for backward, which AOTAutograd refuses)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        in_forward: bool,
    ) -> torch.Tensor:
        ctx.group, ctx.in_forward = group, in_forward  # type: ignore[attr-defined]
        if in_forward:
            return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))
        return tensor.view_as(tensor)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        if ctx.in_forward:  # type: ignore[attr-defined]
            return grad, None, None
        summed = funcol.all_reduce(grad.contiguous(), "sum", ctx.group)  # type: ignore[attr-defined]
        return funcol.wait_tensor(summed), None, None


class ExpertSlices(WholeExperts):
    """How a MoE block sees its experts when each rank of `mesh` (the etp group) holds a slice
    of every one: partial outputs summed, the gradients of their inputs summed too."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()

    def enter(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the same on every etp rank), its gradient summed over etp in backward:
        each rank's slice of the experts contributes a part of it."""
        return _SumOverGroup.apply(tensor, self.group, False)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over etp of the ranks' partial outputs (their gradient is the sum's)."""
        return _SumOverGroup.apply(partial, self.group, True)


def apply_expert_parallel(model: nn.Module, mesh: JobMesh) -> None:
    """Shard every MoE layer's experts over ep and etp, route through all-to-all under ep > 1
    and sum the slices' outputs under etp > 1 (no-op at ep = etp = 1)."""
    emesh = mesh.expert
    if emesh is None or not moe_modules(model):
        return
    degrees = mesh.degrees
    dims = tuple(dim for dim, size in (("ep", degrees.ep), ("etp", degrees.etp)) if size > 1)
    shard_mesh = emesh[dims] if len(dims) > 1 else emesh[dims[0]]
    for key, block in model.layers.items():
        moe = block.feed_forward
        if not isinstance(moe, MoEFeedForward):
            continue
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = [Shard(0) if dim == "ep" else Shard(ETP_DIMS[name]) for dim in dims]
            sharded = distribute_tensor(param.data, shard_mesh, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded))
        # The other gradients are averaged over dp x cp; the experts' over their edp
        # holders (dp / ep x cp) after ep summed them, so divide by the same dp x cp.
        experts.replicas = ExpertReplicas(emesh["edp"], mesh.dp_cp.size())
        if degrees.ep > 1:
            moe.dispatch = AllToAllDispatch(experts, emesh["ep"], int(key))
        if degrees.etp > 1:
            moe.experts_split = ExpertSlices(emesh["etp"])


def expert_replicas(model: nn.Module) -> list[tuple[GroupedExperts, ExpertReplicas]]:
    """The model's EP-sharded expert modules with where their copies live."""
    return [
        (m, m.replicas)
        for m in model.modules()
        if isinstance(m, GroupedExperts) and hasattr(m, "replicas")
    ]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """EP-sharded parameters that DDP must leave alone (reduced here, not by FSDP)."""
    return [p for m, r in expert_replicas(model) if not r.fsdp for p in m.parameters()]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The fully qualified names of `expert_parameters` (for DDP's ignore list)."""
    owned = {id(p) for p in expert_parameters(model)}
    return [name for name, p in model.named_parameters() if id(p) in owned]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module) -> None:
    """Average expert gradients over the ranks that hold the same experts, as dp averages.

    Call once per step after the last backward; a no-op without expert parallelism and for
    experts that FSDP2 reduces.
    """
    for module, replicas in expert_replicas(model):
        if replicas.fsdp:
            continue
        group = replicas.mesh.get_group()
        for param in module.parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if dist.get_world_size(group) > 1:
                dist.all_reduce(grad, group=group)
            grad.div_(replicas.dp)


def expert_width_dims(model: nn.Module) -> dict[int, int]:
    """By parameter id, the model-width dim of every stacked expert weight (`WIDTH_DIMS`)."""
    return {
        id(param): WIDTH_DIMS[name]
        for module in model.modules()
        if isinstance(module, GroupedExperts)
        for name, param in module.named_parameters(recurse=False)
    }


def dropless_dispatch(model: ModelConfig, parallel: ParallelConfig) -> bool:
    """Whether the EP dispatch sizes its slots by learning (and may rerun a step)."""
    return model.moe_experts > 0 and parallel.ep > 1 and model.moe_capacity_factor <= 0


def settle_slot_bounds(model: nn.Module, n_layers: int, device: torch.device) -> bool:
    """Agree on every dropless layer's largest load of the step over all ranks (one
    all-reduce and one host sync) and adapt the slots; True when a slot of any layer on any
    rank overflowed, so the step must run again everywhere. Collective over the world: call
    on every rank or on none."""
    bounds = [
        m.dispatch.bound for m in moe_modules(model) if isinstance(m.dispatch, AllToAllDispatch)
    ]
    # Per layer: the largest load, and by how much it exceeded the slots (a pipeline stage
    # holds only its own layers, so the overflow is agreed on with the loads).
    seen = torch.zeros(2, n_layers, dtype=torch.long, device=device)
    seen[1] = -1
    for bound in bounds:
        if bound.seen is not None:
            seen[0, bound.layer] = bound.seen
            seen[1, bound.layer] = bound.seen - bound.used
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    largest, excess = seen.tolist()
    for bound in bounds:
        bound.settle(largest[bound.layer])
    return max(excess) > 0


@torch.no_grad()
def finish_routing_step(
    model: nn.Module, group: dist.ProcessGroup | None, applied: bool = True
) -> None:
    """Close the step's routing counts: with an applied update, nudge the balancing biases by
    the step's loads summed over `group` (the data-parallel ranks; one all-reduce for all
    layers). Every rank of the group must call it."""
    layers = moe_modules(model)
    biased = [m for m in layers if m.cfg.balance_bias]
    if applied and biased:
        loads = torch.stack([m.step_load() for m in biased])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
        for moe, load in zip(biased, loads, strict=True):
            moe.nudge_bias(load)
    for moe in layers:
        moe.stats.end_step()


def drop_routing_step(model: nn.Module) -> None:
    """Forget the routing counts of a step that runs again."""
    for moe in moe_modules(model):
        moe.stats.drop_step()


def release_router_losses(model: nn.Module) -> None:
    """Drop the router losses the MoE blocks keep from their last forward, or from the
    recomputation of it in backward: call after the backward. Kept, their graph held the
    blocks' activations (under recompute, the outputs it keeps) through the optimizer step
    and into the next step (33 GiB of DeepSeek-V2-Lite's at ep=8, 11 GiB of Mixtral's)."""
    for moe in moe_modules(model):
        moe.aux_loss = None


def add_router_losses(loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """`loss` plus the weighted router losses of the model's last forward (if it has any).

    Under tensor parallelism the loss is a replicated DTensor; the router losses, equal on
    every TP rank, join it with the same placement.
    """
    aux = router_losses(model)
    if aux is None:
        return loss
    if isinstance(loss, DTensor):
        aux = DTensor.from_local(aux, loss.device_mesh, loss.placements)
    return loss + aux
