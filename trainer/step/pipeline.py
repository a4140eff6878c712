"""The optimizer step of a pipelined run: the schedule over the accumulation micro-batches.

The global batch and data order are those of the non-pipelined run: this rank's
accumulation micro-batches (every stage of one pipeline shares a dp rank, so they agree on
them) are concatenated and the schedule splits them into `parallel.pp_microbatches` equal
parts (by default the accumulation count, so the micro-batches are the same). The loss runs
on the last stage, divided by the micro-batch count as accumulation does; the mean loss is
summed over the pipeline group so every stage, rank 0 included, reports the last stage's.
Gradient norms are summed over stages. Tied embeddings: the last stage's copy of the
embedding and the first stage's have their gradients summed after the schedule
(`parallel/pipeline/tied_embedding.py`). A mixture-of-experts stage attaches its router
losses to its output (`parallel/pipeline/moe.py`), so they join the objective of the
micro-batch that produced them; the reported loss is the LM loss alone, as in the plain
step, and expert gradients are reduced over their data-parallel ranks before clipping.
MFU needs nothing special: model FLOPs per token are the same, and the bubble is in the
measured step time, so it never counts as work. Under `data.doc_mask` every stage's forward
takes its micro-batch's document ids (torch splits the keyword arguments of `step` as it
splits the tokens, and hands them to every stage); the validation loss is a forward-only
pass outside the schedule (`trainer/step/pipeline_eval.py`). Under a batch-size ramp or a
sequence-length warm-up the schedule is built again, with the stage's micro-batch count
and shapes, at the first step of a stage (and after a rollback across one).
"""

from __future__ import annotations

import torch

from pretrain.core.schedules import SCHEDULES
from pretrain.parallel.expert import reduce_expert_grads, release_router_losses
from pretrain.parallel.pipeline.shapes import stage_shapes
from pretrain.parallel.pipeline.stages import build_schedule, stage_indices
from pretrain.parallel.pipeline.tied_embedding import (
    embedding_group,
    reduce_tied_grads,
    sync_embedding_copies,
)
from pretrain.parallel.tensor import local_value
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import SLOT_RETRIES, apply_gradients, run_again_for_slots
from pretrain.trainer.step.pipedream import PipeDreamStep
from pretrain.trainer.step.pipeline_eval import evaluate_pipeline, score_pipeline
from pretrain.trainer.step.state import MicroBatches, StepResult


def pipeline_step(ctx: StepContext) -> PipelineStep | PipeDreamStep:
    """The step of the recipe's schedule: torch's (`PipelineStep`) or, for pp_schedule=2bw,
    the in-repo PipeDream-2BW (`trainer/step/pipedream.py`); both are `Stepper`s with the
    pipeline group as `group`."""
    if SCHEDULES[ctx.cfg.parallel.pp_schedule].torch_class is None:
        return PipeDreamStep(ctx)
    return PipelineStep(ctx)


class PipelineStep:
    """Runs one optimizer step of a pipeline-parallel layout on this rank."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx, self.state = ctx, ctx.state
        self.group = ctx.pipeline_group
        stages = stage_indices(ctx.pipeline_rank, ctx.cfg.parallel)
        self.has_first = 0 in stages
        self.has_last = ctx.degrees.pp * ctx.cfg.parallel.vpp - 1 in stages
        self.n_microbatches = ctx.pipeline_microbatches
        self.losses: list[torch.Tensor] = []
        for chunk in ctx.state.model:
            ctx.prepare_stage(chunk)
        self.embedding_group = embedding_group(ctx.cfg, ctx.degrees)
        self.stages = stages
        self.built: tuple[int, int, int] = (0, 0, 0)
        self._build(self.n_microbatches, ctx.accumulation * ctx.cfg.train.micro_batch)

    def _build(self, n_microbatches: int, sequences: int, seq_len: int | None = None) -> None:
        """The schedule of `n_microbatches` micro-batches over this rank's `sequences` of
        `seq_len` (the recipe's by default): the stages' shapes are fixed in it."""
        seq_len = seq_len or self.ctx.cfg.train.seq_len
        self.n_microbatches = n_microbatches
        self.shapes = stage_shapes(
            self.ctx.cfg, self.ctx.degrees, n_microbatches, sequences, seq_len
        )
        self.schedule = build_schedule(
            list(self.state.model),
            self.stages,
            self.ctx.cfg.parallel,
            n_microbatches,
            self._loss,
            self.group,
            self.ctx.device,
            self.shapes,
            on_stage=self._time_backwards,
        )
        self.built = (n_microbatches, sequences, seq_len)

    def _fit(self, micro_batches: MicroBatches) -> None:
        """Build the schedule again when a ramp's stage changes this rank's batch: its count
        of micro-batches, its sequences or their length (every stage of the pipeline reads
        the same micro-batches, so all of them rebuild at the same step)."""
        ctx = self.ctx
        ctx.accumulation = len(micro_batches)
        sequences = sum(len(x) for x, _ in micro_batches)
        key = (ctx.pipeline_microbatches, sequences, micro_batches[0][0].shape[1])
        if key != self.built:
            self._build(*key)

    def _time_backwards(self, stage) -> None:
        """Time a stage's backwards (input and, split off by zero-bubble schedules, weight
        gradients) as the step's backward region."""
        for name in ("backward_one_chunk", "backward_weight_one_chunk"):
            run = getattr(stage, name)

            def timed(*args, run=run, **kwargs):
                with self.ctx.timed("backward"):
                    return run(*args, **kwargs)

            setattr(stage, name, timed)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.ctx.timed("forward"):
            loss = self.state.loss_fn(logits, targets)
        # Every TP rank holds the same (replicated) loss.
        self.losses.append(local_value(loss.detach()))
        return self.ctx.scaled_term(loss)

    def step(self, micro_batches: MicroBatches) -> StepResult:
        """Forward and backward of this rank's micro-batches through the pipeline, then the
        optimizer; returns the step's mean loss (on every stage), the global grad norm and
        what all ranks agreed (bad, stop), as `train_step` does."""
        ctx = self.ctx
        self._fit(micro_batches)
        # The copy's only reader is this step's MTP modules: the last update or load left it.
        sync_embedding_copies(self.state.plain)
        inputs, targets = ctx.whole_batch(micro_batches)
        args = (inputs,) if self.has_first else ()
        # Every stage's attention takes the documents, and the last stage's multi-token
        # prediction the tokens (torch splits them as the tokens).
        # Documents are counted on whole sequences, before the context-parallel split.
        kwargs = ctx.train_kwargs(ctx.whole_inputs(micro_batches))
        phases = self.state.phases
        for _ in range(SLOT_RETRIES):
            self.losses = []
            # This rank's forwards and backwards are timed inside; the rest is its bubble.
            with phases.phase("pipeline"), ctx.loss_parallel():
                # The last stage's outputs (the logits) are not merged and kept to the end.
                self.schedule.step(
                    *args,
                    target=targets if self.has_last else None,
                    return_outputs=False,
                    **kwargs,
                )
            if not run_again_for_slots(self.state, ctx.cfg, ctx.device):
                break
        else:
            raise RuntimeError(f"the MoE dispatch slots overflowed {SLOT_RETRIES} runs of one step")
        with phases.phase("backward"):
            release_router_losses(self.state.plain)
            reduce_expert_grads(self.state.plain)
            reduce_tied_grads(self.state.plain, self.embedding_group)
        loss = ctx.pipeline_mean(self.losses[-self.n_microbatches :] if self.has_last else [])
        with phases.phase("optimizer"):
            return StepResult(
                loss, *apply_gradients(self.state, ctx.cfg, ctx.guard, loss, self.group)
            )

    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The mean validation loss of this pipeline's micro-batches (forward only, outside
        the schedule: `trainer/step/pipeline_eval.py`), on every stage."""
        self.ctx.accumulation = len(micro_batches)
        return evaluate_pipeline(self.ctx, list(self.state.model), micro_batches)

    def score(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The task scores of this pipeline's micro-batches (forward only, as `evaluate`)."""
        return score_pipeline(self.ctx, list(self.state.model), micro_batches)
