"""Router losses and routing statistics of mixture-of-experts blocks inside a pipeline.

The plain step adds the router losses a forward leaves in the MoE blocks to the loss of the
same micro-batch. A pipeline schedule cannot: the loss function runs on the last stage only,
and a stage runs a micro-batch's backward after the forwards of others, which overwrite the
blocks' `aux_loss`. So each stage chunk's forward attaches its own blocks' router losses to
its output with `AttachLoss`, an identity on the output whose backward also sends the
losses the gradient they would get as a term of the micro-batch's objective (the loss scale
over the micro-batch count, as the LM loss). Whatever the schedule, a micro-batch's router
losses then join its backward, on the stage that produced them.

No stage runs a forward of its own to infer shapes (they are given:
`parallel/pipeline/shapes.py`), so the expert-load metrics count the step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pretrain.models.moe import moe_modules, router_losses


class AttachLoss(torch.autograd.Function):
    """`output`'s values; its backward also gives the scalar `aux` the gradient `weight`.

    So `aux * weight` is part of the objective of the backward that runs through `output`,
    without the schedule or the loss function knowing about it.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(weight)
        ctx.aux_dtype = aux.dtype
        # A copy, not a view: the split-backward schedules detach a stage's output in place
        # after its input gradient (torch's stage_backward_input), which a view refuses. The
        # block's own output is not saved for backward, so the copy replaces it.
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad_output, weight.to(ctx.aux_dtype), None


def attach_router_losses(chunk: nn.Module, weight: Callable[[], torch.Tensor]) -> None:
    """Make `chunk`'s forward attach its MoE blocks' router losses to its output (in place).

    `weight()` is the gradient of one micro-batch's objective term at forward time (loss
    scale / micro-batch count). A chunk without MoE blocks is left as it is.
    """
    blocks = moe_modules(chunk)
    if not blocks:
        return
    forward = chunk.forward

    def run(*args, **kwargs):
        output = forward(*args, **kwargs)
        aux = router_losses(chunk)
        for block in blocks:
            block.aux_loss = None  # the graph lives on in the output's, not in the block
        return AttachLoss.apply(output, aux, weight())

    chunk.forward = run
