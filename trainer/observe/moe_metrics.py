"""Routing metrics of a mixture-of-experts model: expert load, dropped tokens, router losses.

Counted since the last read, summed over the data- and context-parallel ranks (every one
routes its own tokens, and a cp rank's balance term is its part of the sequence's, their
mean the sequence's loss; tensor-parallel ranks route the same ones, so they are not
summed) and gathered from the pipeline stages, per step:

- moe_tokens_per_expert_{min,max,mean}: assignments an expert received per step, over every
  MoE layer's experts (mean = tokens x k / N; max / mean is the load imbalance);
- moe_dropped_frac: the share of assignments dropped by the capacity limit;
- moe_aux_loss, moe_z_loss: the unweighted load-balancing and z losses, averaged over MoE
  layers and forwards (the balance loss is 1 when the load is even).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pretrain.models.moe import moe_modules


def expert_load_metrics(
    model: nn.Module,
    routing_group: dist.ProcessGroup | None,
    steps: int,
    pp_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The routing metrics of the last `steps` steps (empty for a dense model); resets them.

    With `pp_group` (pipeline parallelism) each stage holds some of the layers, or none: the
    stages' layers are gathered so every stage reports the whole model's, once.
    """
    layers = [m for m in moe_modules(model) if m.stats.totals is not None]
    rows = [m.stats.totals for m in layers]
    forwards = sum(m.stats.forwards for m in layers)
    for m in layers:
        m.stats.reset()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        stages: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, ([r.cpu() for r in rows], forwards), group=pp_group)
        device = next(model.parameters()).device
        rows = [r.to(device) for stage_rows, _ in stages for r in stage_rows]
        forwards = sum(count for _, count in stages)
    if not rows:
        return {}
    totals = torch.stack(rows)  # [layers, N + 3]
    if routing_group is not None and dist.get_world_size(routing_group) > 1:
        dist.all_reduce(totals, group=routing_group)
        ranks = dist.get_world_size(routing_group)
    else:
        ranks = 1
    routed = totals[:, :-3].double() / steps
    assignments = totals[:, :-3].sum().item()
    return {
        "moe_tokens_per_expert_min": routed.min().item(),
        "moe_tokens_per_expert_max": routed.max().item(),
        # From the integer total, not a mean of rounded quotients: exactly tokens x k / N.
        "moe_tokens_per_expert_mean": assignments / (steps * routed.numel()),
        "moe_dropped_frac": totals[:, -3].sum().item() / assignments,
        "moe_aux_loss": (totals[:, -2].sum() / (forwards * ranks)).item(),
        "moe_z_loss": (totals[:, -1].sum() / (forwards * ranks)).item(),
    }
