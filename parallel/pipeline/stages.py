"""Pipeline parallelism: split the plain model into this rank's stages, and run a schedule.

Splitting is ours (`core/stages.py` says which layers each stage holds): a stage is the
plain `Transformer` with the other layers deleted, the embedding kept only on the first
stage and the final norm and LM head only on the last, so parameter names stay those of the
full model and checkpoints and initialization do not depend on the split. With vpp > 1 a
rank holds several such chunks (stages r, r + pp, ...). Schedules come from
`torch.distributed.pipelining`; the loss runs on the last stage inside the schedule. Each
stage is told its shapes (`parallel/pipeline/shapes.py`), so torch infers none.

With tied embeddings the last stage's head is its own copy of the embedding, whose
gradient is summed with the first stage's every step (`parallel/pipeline/tied_embedding.py`).
Multi-token prediction modules live on the last stage, which keeps a copy of the embedding
for them (the tied head then shares that copy), kept alike the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pretrain.core.schedules import SCHEDULES, splits_backward
from pretrain.core.schema import ParallelConfig
from pretrain.core.stages import placement, rank_stages, stage_layers
from pretrain.parallel.pipeline.shapes import StageShapes
from pretrain.parallel.pipeline.split_backward import gather_before_split_backward


def schedule_classes() -> dict[str, type]:
    """torch's schedule class for each `parallel.pp_schedule` torch runs (all but 2BW, ours),
    the class the schedule table names.

    Imported on first use: torch.distributed.pipelining brings in torch._dynamo, about 0.6 s
    of every rank's start-up, which a run without a pipeline does not need.
    """
    from torch.distributed.pipelining import schedules

    return {
        name: getattr(schedules, traits.torch_class)
        for name, traits in SCHEDULES.items()
        if traits.torch_class is not None
    }


MULTI_STAGE = tuple(
    name for name, traits in SCHEDULES.items() if traits.torch_class and traits.multi_stage
)
"""Schedules that take a list of stages per rank (any vpp, including 1; the V ones 2)."""


def split_stage(model: nn.Module, stage: int, parallel: ParallelConfig) -> nn.Module:
    """Reduce the full meta-device model to pipeline stage `stage`, in place, and return it."""
    n_layers = len(model.layers)
    stages = stage_layers(n_layers, parallel.pp, parallel.vpp, parallel.pp_layers)
    keep = {str(i) for i in stages[stage]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    last = stage == len(stages) - 1
    if stage != 0 and not (last and model.mtp is not None):
        model.tok_embeddings = None
    elif stage != 0:
        # The multi-token prediction modules embed the tokens ahead: a copy, kept alike.
        model.keeps_embedding_copy = True
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    if parallel.sp and parallel.tp > 1 and stage != 0:
        # Hidden states arrive sequence-sharded: the rotary tables need the full length.
        model.sequence_shards = parallel.tp
    return model


def stage_indices(pp_rank: int, parallel: ParallelConfig) -> list[int]:
    """The stages this pipeline rank runs, in model order."""
    return rank_stages(pp_rank, parallel.pp, parallel.vpp, placement(parallel.pp_schedule))


def in_context(module: nn.Module, context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run `module`'s forward inside `context()` (autocast, FP8), leaving its backward out.

    The schedule interleaves forwards and backwards, so the context cannot wrap the step.
    """
    forward = module.forward

    def run(*args, **kwargs):
        with context():
            return forward(*args, **kwargs)

    module.forward = run


def build_schedule(
    chunks: list[nn.Module],
    stages: list[int],
    parallel: ParallelConfig,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    shapes: StageShapes,
    on_stage: Callable[[Any], None] = lambda stage: None,
):
    """The schedule over this rank's stage modules (wrapped for data parallelism), each
    stage given its input and output shapes (`shapes`), so none is inferred at the first step.
    `on_stage` is called with each `PipelineStage` built (the trainer times its backwards).

    Gradients are not scaled by the schedule: `loss_fn` divides by the micro-batch count, as
    gradient accumulation does, so the fp16 loss scale and the mean stay in one place.
    """
    from torch.distributed.pipelining import PipelineStage

    total = parallel.pp * parallel.vpp
    pipeline_stages = []
    for chunk, index in zip(chunks, stages, strict=True):
        inputs, outputs = shapes.examples(index, total)
        stage = PipelineStage(
            chunk, index, total, device, input_args=inputs, output_args=outputs, group=group
        )
        if splits_backward(parallel.pp, parallel.pp_schedule):
            gather_before_split_backward(stage)
        on_stage(stage)
        pipeline_stages.append(stage)
    schedule_class = schedule_classes()[parallel.pp_schedule]
    if parallel.pp_schedule in MULTI_STAGE:
        return schedule_class(
            pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    (stage,) = pipeline_stages
    return schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class StageView(nn.Module):
    """This rank's chunks seen as one model with the full model's parameter names.

    The chunks keep owning their modules (and their FSDP/DDP wrapping); the view only
    registers the same submodules under the full model's structure, for the optimizer,
    gradient clipping and checkpoints.

    Under a V schedule the last stage's copy of the embedding (for its MTP modules) sits
    beside the embedding itself: the view registers the embedding only and keeps the copy
    in `embedding_copies`, outside the optimizer and the checkpoint; its gradient is summed
    into the embedding's and it takes the embedding's weights (`sync_embedding_copies`).
    """

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        # Plain lists, not registered: the chunks' modules are registered below, by name.
        self.chunks = list(chunks)
        self.embedding_copies: list[nn.Module] = []
        self.layers = nn.ModuleDict()
        holds_embedding = any(
            c.tok_embeddings is not None and not c.keeps_embedding_copy for c in chunks
        )
        for chunk in chunks:
            for name in ("tok_embeddings", "norm", "output", "mtp"):
                module = getattr(chunk, name, None)
                if module is None:
                    continue
                if name == "tok_embeddings" and holds_embedding and chunk.keeps_embedding_copy:
                    self.embedding_copies.append(module)
                    continue
                setattr(self, name, module)
            for key, block in chunk.layers.items():
                self.layers[key] = block
