"""The optimizer step of a PipeDream-2BW run (`parallel.pp_schedule=2bw`).

Each call runs one step of the never-flushed pipeline (`parallel/pipeline/pipedream.py`): this
step's forwards and most of its backwards, and the previous step's last backwards. At its end the
previous step's gradient is complete and is applied, one step late, to a copy of the
weights in use, which the next step runs on; so the step returns this step's loss and the
norm of the update it applied: the previous step's gradient (in a segment's first step,
which applies none, the one the drain before it applied, or NaN at the start). The
trainer's state always names the newest version `plain` (the optimizer's) and the other
`stash`, which checkpoints save beside it; `settle` drains the pipeline before a
checkpoint, applying the last gradient, so a checkpoint holds both versions and no
activations, and a resumed run continues the same recurrence (after a refill).

Agreement: clipping needs the global gradient norm, and every rank must agree on bad
steps and on a stop. A blocking collective at each step's end would make every rank wait
for the one that ends last and re-open the bubble, so each rank starts one non-blocking
all-reduce (its stage's squared norm, a non-finite loss, a stop request) on a group of its
own as soon as its gradient of a step is complete, and waits for it only at the update, a
step later, by when every rank has long contributed. (A segment's first step, which applies
no update, agrees on a stop the blocking way.)

Micro-batches and the loss follow `trainer/step/pipeline.py`: this rank's accumulation
micro-batches, re-split into `parallel.pp_microbatches`, the loss divided by their count,
and every stage's forward takes its micro-batch's document ids under `data.doc_mask`. The
validation loss after step k is that of W(k+1), the weights step k+1 runs on, through the
forward-only pass every pipelined step shares (`trainer/step/pipeline_eval.py`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pretrain.models.moe import moe_modules
from pretrain.parallel.clip import clip_to_norm, grad_norm
from pretrain.parallel.expert import reduce_expert_grads, release_router_losses
from pretrain.parallel.pipeline.pipedream import P2PTransport, PipeDream, Version, move_optimizer
from pretrain.parallel.pipeline.shapes import stage_shapes
from pretrain.parallel.pipeline.stages import StageView
from pretrain.parallel.pipeline.tied_embedding import (
    embedding_group,
    head_copies,
    start_tied_grad_sum,
)
from pretrain.parallel.tensor import local_value
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import step_optimizer
from pretrain.trainer.step.pipeline_eval import evaluate_pipeline, score_pipeline
from pretrain.trainer.step.state import MicroBatches, StepResult


def read_agreement(flags: torch.Tensor, norm: torch.Tensor) -> tuple[bool, bool, bool]:
    """(a non-finite loss on some rank, a finite global norm, a stop requested) from the
    agreed flags and norm: the values an update reads back (on the host)."""
    return bool(flags[1] > 0), bool(torch.isfinite(norm)), bool(flags[2] > 0)


class PipeDreamStep:
    """Runs one 2BW step on this pipeline rank, and drains before checkpoints."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx, self.state = ctx, ctx.state
        state, degrees, device = ctx.state, ctx.degrees, ctx.device
        self.group = ctx.pipeline_group
        rank = ctx.pipeline_rank
        self.n_microbatches = ctx.pipeline_microbatches
        self.versions: dict[int, tuple[Version, StageView]] = {}
        for view in (state.stash, state.plain):
            (chunk,) = view.chunks
            ctx.prepare_stage(chunk)
            version = Version(chunk, list(view.parameters()))
            self.versions[id(version)] = (version, view)
        stash, plain = (v for v, _ in self.versions.values())
        # Whichever version routes a micro-batch, the expert-load metrics count it once.
        for older, newer in zip(moe_modules(state.stash), moe_modules(state.plain), strict=True):
            older.stats = newer.stats
        self.owner = plain  # the version the optimizer holds
        shapes = stage_shapes(ctx.cfg, degrees, self.n_microbatches)
        hidden = (shapes.batch, shapes.hidden_tokens, shapes.dim)
        transport = P2PTransport(self.group, rank, degrees.pp, device, hidden, shapes.hidden_dtype)
        self.engine = PipeDream(
            (stash, plain),
            degrees.pp,
            rank,
            self.n_microbatches,
            self._loss,
            transport,
            self._update,
            self._gradient_ready,
            timed=ctx.timed,
        )
        # Tied embeddings: the first and the last rank sum their copies' gradients.
        self.embedding_group = embedding_group(ctx.cfg, degrees)
        self.tied_sums: list[dist.Work] = []
        # The agreements run beside the pipeline's traffic and the step's own collectives.
        self.agree_group = dist.new_group(backend=dist.get_backend())
        self.replicas = dist.get_world_size() // degrees.pp  # ranks per stage
        self.agreements: list[tuple[torch.Tensor, dist.Work]] = []
        self._losses: list[torch.Tensor] = []
        self.result: tuple[torch.Tensor, bool, bool] | None = None
        self.drained: tuple[torch.Tensor, bool] | None = None
        state.settle = self.drain

    def _head_of(self, version: Version) -> None:
        """Point the chunked losses (`train.loss_chunks` > 1) at `version`'s LM head."""
        for chunked in self.state.chunked_losses:
            chunked.head = self.versions[id(version)][1].output

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Called by the engine right after the forward of the version it runs.
        self._head_of(self.engine.running)
        with self.ctx.timed("forward"):
            loss = self.state.loss_fn(logits, targets)
        self._losses.append(local_value(loss.detach()))
        return self.ctx.scaled_term(loss)

    def _gradient_ready(self, version: Version) -> None:
        """Start agreeing on a finished gradient: (global) norm, bad loss, stop."""
        view = self.versions[id(version)][1]
        reduce_expert_grads(view)
        self.state.scaler.unscale_(view.parameters())
        copies = {id(p) for p in head_copies(view)}
        tied = start_tied_grad_sum(view, self.embedding_group)
        if tied is not None and copies:
            # The last stage finishes a step's gradient first: its copy needs the sum only
            # at the update, and leaves the norm, which counts the embedding once.
            self.tied_sums.append(tied)
        elif tied is not None:
            # The first stage finishes last, its twin's half already sent: the embedding's
            # norm counts the sum.
            tied.wait()
        # Every rank of a stage holds its stage's squared norm (grad_norm reduces within it).
        squared = grad_norm([p for p in view.parameters() if id(p) not in copies]) ** 2
        last_loss = torch.stack(self._losses).sum() if self.engine.last else squared * 0
        flags = torch.stack(
            [
                squared,
                (~torch.isfinite(last_loss)).float(),
                torch.tensor(float(self._stop_requested()), device=self.ctx.device),
            ]
        )
        work = dist.all_reduce(flags, group=self.agree_group, async_op=True)
        self.agreements.append((flags, work))

    def _stop_requested(self) -> bool:
        return self.ctx.guard is not None and self.ctx.guard.stop_requested()

    def _update(self, target: Version, source: Version) -> None:
        """Step `target` (a copy of `source`'s weights holding the finished gradient) with
        the optimizer, which takes over `target`; it becomes the state's newest version."""
        state = self.state
        target_view, source_view = self.versions[id(target)][1], self.versions[id(source)][1]
        move_optimizer(state.optimizer, self.owner.params, target.params)
        self.owner = target
        state.plain, state.stash = target_view, source_view
        state.model = nn.ModuleList(target_view.chunks)
        flags, work = self.agreements.pop(0)
        work.wait()
        if self.tied_sums:
            self.tied_sums.pop(0).wait()
        norm = (flags[0] / self.replicas).sqrt()
        state.stability.gradients(state.plain)
        clip_to_norm(state.plain.parameters(), norm, self.ctx.cfg.optim.grad_clip)
        scaled_ok = state.scaler.update(norm)
        bad_loss, finite_norm, stop = read_agreement(flags, norm)
        bad = bad_loss or (scaled_ok and not finite_norm)
        step_optimizer(state, self.ctx.cfg, update=scaled_ok and not bad)
        self.result = (norm, bad, stop)

    def step(self, micro_batches: MicroBatches) -> StepResult:
        """This step's forwards and backwards (and the previous step's last backwards),
        then the previous step's update; returns this step's mean loss (on every stage),
        the norm of the update applied (NaN when none was) and (bad, stop)."""
        ctx = self.ctx
        inputs, targets = ctx.whole_batch(micro_batches)
        self.result, self._losses = None, []
        engine = self.engine
        with ctx.loss_parallel():
            # This rank's forwards and backwards are timed inside; the rest is its bubble.
            with ctx.timed("pipeline"):
                ops = engine.begin(
                    list(torch.tensor_split(inputs, self.n_microbatches)) if engine.first else [],
                    list(torch.tensor_split(targets, self.n_microbatches)) if engine.last else [],
                    ctx.microbatch_kwargs(ctx.whole_inputs(micro_batches)),
                )
                for op in ops:
                    engine.run(*op)
            release_router_losses(self.state.plain)
            if self.state.stash is not None:
                release_router_losses(self.state.stash)
            loss = ctx.pipeline_mean(self._losses if engine.last else [])
            with ctx.timed("optimizer"):  # the previous step's update
                engine.end()
        if self.result is not None:  # this step applied the previous step's gradient
            return StepResult(loss, *self.result)
        # A segment's first step applies none: it reports the update of the drain before
        # it, if any, and the ranks agree on its loss (and on a stop) alone.
        norm, bad = self.drained or (torch.tensor(math.nan, device=ctx.device), False)
        self.drained = None
        if ctx.guard is None:  # one-process tools: decided locally
            agreed_bad, stop = not bool(torch.isfinite(loss)), False
        else:
            agreed_bad, stop = ctx.guard.agree(loss, torch.zeros((), device=ctx.device))
        return StepResult(loss, norm, bad or agreed_bad, stop)

    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The mean validation loss of this pipeline's micro-batches, on every stage, under
        the weights the next step runs on: W(k+1) after step k, with or without a drain (a
        drain also writes W(k+2), which step k+1 must not see). A forward-only pass of its
        own, beside the backwards still in flight, which it leaves as they are."""
        self._head_of(self.engine.running)
        return evaluate_pipeline(self.ctx, [self.engine.running.module], micro_batches)

    def score(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The task scores of this pipeline's micro-batches under the weights the next step
        runs on, as `evaluate` takes its loss."""
        self._head_of(self.engine.running)
        return score_pipeline(self.ctx, [self.engine.running.module], micro_batches)

    def drain(self) -> None:
        """Run the backwards still in flight and apply the last step's gradient: the state
        then holds two complete weight versions and no activations (before a checkpoint)."""
        with self.ctx.loss_parallel():
            for op in self.engine.drain_ops():
                self.engine.run(*op)
            self.result = None
            self.engine.end_drain()
            self.drained = self.result[:2] if self.result is not None else None
