"""Expert parallelism: the routed experts sharded over an EP group carved from data parallelism.

The EP group: the flattened data-parallel index (dp_replicate x dp_shard) splits into
(dp / ep, ep), ep inner, exactly as `pretrain_core.layout.rank_groups` lists the "ep" groups. A
second DeviceMesh (pp, edp, ep, tp) over the same ranks names both halves: `ep` (the ranks
that share one set of tokens' experts) and `edp` (the ranks that hold the same experts).

- Parameters: each MoE layer's stacked expert weights become DTensors sharded on dim 0 over
  `ep`, so rank i holds experts [i*N/ep, (i+1)*N/ep). Initialization draws the full stacked
  tensor by name and slices it (parallel/materialize.py), gradient clipping sums their norms
  over `ep` (parallel/clip.py), both through DTensor.
- Dispatch, per MoE layer and micro-batch: the block groups its kept assignments by expert;
  here the per-expert counts are exchanged, tokens travel to their experts' ranks with an
  `all_to_all_single` of uneven splits (the functional autograd form, so the backward sends
  the gradients home), are regrouped by local expert, run, and travel back the same way.
- Gradients: expert weights see the tokens of the whole EP group, so their gradients are
  reduced over `edp` only. They are left out of DDP and FSDP (which reduce over all of dp)
  and all-reduced here once per step (`reduce_expert_grads`), summed and divided by dp to
  match the mean the data-parallel wrappers take of every other gradient. ZeRO therefore
  shards the dense parameters; the experts are sharded by ep alone.
- Tensor parallelism: a MoE layer is not split over tp (`parallel/tensor.py` hands it the
  full sequence, replicated): every TP rank routes the same tokens and dispatches within its
  own EP group, which holds the ranks of the same tp index.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.moe import GroupedExperts, moe_modules, router_losses
from parallel.mesh import JobMesh
from pretrain_core.schema import ParallelConfig

EXPERT_MESH_DIMS = ("ep_pp", "edp", "ep", "ep_tp")


def expert_mesh(mesh: JobMesh, ep: int) -> DeviceMesh:
    """The (pp, dp / ep, ep, tp) mesh over the job's ranks; ep is the inner part of dp."""
    pp, tp, dp = mesh.world["pp"].size(), mesh.world["tp"].size(), mesh.dp.size()
    return init_device_mesh(
        mesh.world.device_type, (pp, dp // ep, ep, tp), mesh_dim_names=EXPERT_MESH_DIMS
    )


class AllToAllDispatch:
    """Runs tokens grouped by (global) expert on the experts' ranks of the EP group."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        self.experts = experts
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        # received[r, e]: rows source rank r sends for my local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        received_rows = received.view(ep, local)
        recv_splits = received_rows.sum(1).tolist()
        tokens = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        # Arrived grouped by (source rank, expert); the experts want (expert, source rank).
        blocks = received_rows.flatten().tolist()
        chunks = tokens.split(blocks)
        by_expert = [chunks[r * local + e] for e in range(local) for r in range(ep)]
        out = self.experts(torch.cat(by_expert), received_rows.sum(0).tolist())
        out_chunks = out.split([blocks[r * local + e] for e in range(local) for r in range(ep)])
        by_source = [out_chunks[e * ep + r] for r in range(ep) for e in range(local)]
        return all_to_all_single_autograd(
            torch.cat(by_source), send_splits, recv_splits, self.group
        )


def apply_expert_parallel(model: nn.Module, mesh: JobMesh, parallel: ParallelConfig) -> None:
    """Shard every MoE layer's experts over ep and route through all-to-all (no-op at ep=1)."""
    if parallel.ep == 1 or not moe_modules(model):
        return
    emesh = expert_mesh(mesh, parallel.ep)
    ep_mesh, edp_group = emesh["ep"], emesh["edp"].get_group()
    for moe in moe_modules(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded))
        experts.grad_reduce = (edp_group, mesh.dp.size())
        moe.dispatch = AllToAllDispatch(experts, ep_mesh)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sharded by expert parallelism, which data parallelism must leave alone."""
    return [
        p
        for m in model.modules()
        if isinstance(m, GroupedExperts) and hasattr(m, "grad_reduce")
        for p in m.parameters()
    ]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The fully qualified names of `expert_parameters` (for DDP's ignore list)."""
    owned = {id(p) for p in expert_parameters(model)}
    return [name for name, p in model.named_parameters() if id(p) in owned]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module) -> None:
    """Average expert gradients over the ranks that hold the same experts, as dp averages.

    Call once per step after the last backward; a no-op without expert parallelism.
    """
    for module in model.modules():
        if not (isinstance(module, GroupedExperts) and hasattr(module, "grad_reduce")):
            continue
        group, dp = module.grad_reduce
        for param in module.parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if dist.get_world_size(group) > 1:
                dist.all_reduce(grad, group=group)
            grad.div_(dp)


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
