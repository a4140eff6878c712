"""The step context: what every stepper reads, built once per run, and the hooks they share.

`setup` builds one `StepContext`; the local step, the pipeline step over torch's schedules
and the PipeDream-2BW step all consume it. A hook every step applies (the forward's
autocast, the vocab-parallel loss, the context-parallel split of the sequences, the
document mask, the tokens ahead of multi-token prediction, the pipeline's loss scaling per
micro-batch) is written here once, so a new
one goes in one place, not in each stepper.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pretrain.core.layout import Degrees, grad_accum_steps, uses_fsdp
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.mesh import JobMesh
from pretrain.parallel.pipeline.moe import attach_router_losses
from pretrain.parallel.pipeline.stages import in_context
from pretrain.parallel.precision import forward_context
from pretrain.parallel.tensor import vocab_parallel_loss
from pretrain.trainer.faults.step_guard import StepGuard
from pretrain.trainer.step.scoring import row_scores
from pretrain.trainer.step.state import MicroBatches, TrainState


def document_ids(inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """The document of each input position [b, s]: how many end-of-sequence tokens come
    before it (an EOS belongs to the document it ends; the token after starts the next)."""
    ends = (inputs == eos).to(torch.int32)
    return ends.cumsum(1) - ends


@dataclass
class StepContext:
    """One run's step: the state it trains and everything a stepper reads besides the
    micro-batches."""

    state: TrainState
    cfg: RecipeConfig
    degrees: Degrees
    device: torch.device
    mesh: JobMesh | None = None
    """The job's mesh; the pipeline steppers take their group from it (None: one process
    without a pipeline, as in the one-process tools and benchmarks)."""
    guard: StepGuard | None = None
    """Agrees with the other ranks on bad steps and stops; None decides locally."""
    doc_eos: int | None = None
    """The end-of-sequence id when data.doc_mask is on: attention stays in a document."""
    weights_cast: bool = field(init=False)
    """Whether FSDP's mixed-precision policy already casts the weights (no autocast then)."""
    accumulation: int = field(init=False)
    """This rank's micro-batches in the batch the pipeline runs now: the recipe's
    accumulation count, or under a batch-size ramp the step's (set by the pipelined step)."""

    def __post_init__(self) -> None:
        self.weights_cast = uses_fsdp(self.cfg.parallel, self.degrees)
        self.accumulation = grad_accum_steps(self.cfg)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward runs in: autocast where FSDP does not cast (and TE's FP8)."""
        return forward_context(self.cfg.precision, self.device, weights_cast=self.weights_cast)

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """The context the loss runs in: vocab-parallel under tensor parallelism."""
        return vocab_parallel_loss(enabled=self.degrees.tp > 1)

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword arguments besides the tokens, from the whole `inputs` (before
        `split`): the documents under doc_mask, this rank's chunks of them under cp."""
        if self.doc_eos is None:
            return {}
        # Counted over whole sequences: a chunk's first document may have begun before it.
        doc_ids = document_ids(inputs, self.doc_eos)
        split = self.state.context
        return {"doc_ids": doc_ids if split is None else split.shard(doc_ids)}

    def train_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """`model_kwargs` of a training forward: with multi-token prediction also the whole
        `inputs` as `mtp_tokens`, whose tokens ahead the MTP modules embed (validation leaves
        them out, so its loss is the next-token one)."""
        kwargs = self.model_kwargs(inputs)
        if self.cfg.model.mtp_layers:
            kwargs["mtp_tokens"] = inputs
        return kwargs

    def split(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunks of the sequences under context parallelism (all of them else)."""
        split = self.state.context
        return (inputs, targets) if split is None else (split.shard(inputs), split.shard(targets))

    def context_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of whole sequences: context-parallel ranks each hold two chunks of every
        sequence, and the loss is their mean."""
        return loss if self.state.context is None else self.state.context.mean(loss)

    def context_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A sum over whole sequences of `value`, summed over their chunks under context
        parallelism (the scores of `row_scores`)."""
        return value if self.state.context is None else self.state.context.sum(value)

    def row_scores(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The task scores of this rank's chunk of each row (`trainer/step/scoring.py`): the
        head applied here, in loss chunks, where the loss applies it."""
        chunked = self.state.chunked_losses
        head = chunked[0].head if chunked else None
        return row_scores(output, targets, head, self.cfg.train.loss_chunks)

    # The pipelined steps: one batch through a schedule of `pipeline_microbatches` parts.

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline, one per stage."""
        assert self.mesh is not None, "a pipelined step needs the job's mesh"
        return self.mesh.world["pp"].get_group()

    @property
    def pipeline_rank(self) -> int:
        """This rank's place in its pipeline."""
        assert self.mesh is not None, "a pipelined step needs the job's mesh"
        return self.mesh.world["pp"].get_local_rank()

    @property
    def pipeline_microbatches(self) -> int:
        """The parts a pipeline schedule splits this rank's batch into (by default the
        accumulation count, so the micro-batches are those of the unpipelined run)."""
        return self.cfg.parallel.pp_microbatches or self.accumulation

    def whole_inputs(self, micro_batches: MicroBatches) -> torch.Tensor:
        """This rank's micro-batches' inputs as one tensor on the device, whole sequences (not
        split over context parallelism): what `model_kwargs` counts documents on."""
        return torch.cat([x for x, _ in micro_batches]).to(self.device)

    def whole_batch(self, micro_batches: MicroBatches) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batches as one (inputs, targets) pair on the device, split over
        context parallelism; the schedule splits it again into its micro-batches."""
        targets = torch.cat([y for _, y in micro_batches]).to(self.device)
        return self.split(self.whole_inputs(micro_batches), targets)

    def microbatch_kwargs(self, inputs: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """`model_kwargs` of each of the `pipeline_microbatches` parts of this rank's batch
        (`whole_inputs`: before the context-parallel split), in order: every stage's forward
        takes its micro-batch's (the documents), and every stage holds the tokens to compute
        them from."""
        parts = torch.tensor_split(inputs, self.pipeline_microbatches)
        return [self.model_kwargs(part) for part in parts]

    def pipeline_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch `losses` (none on the other stages), on
        every stage of the pipeline."""
        loss = torch.zeros((), device=self.device)
        if losses:
            loss += torch.stack(losses).sum() / self.pipeline_microbatches
        dist.all_reduce(loss, group=self.pipeline_group)
        return self.context_mean(loss)

    def scaled_term(self, loss: torch.Tensor) -> torch.Tensor:
        """One pipeline micro-batch's part of the objective: its loss divided by their count,
        as accumulation does, times the loss scale."""
        return self.state.scaler.scale_loss(loss / self.pipeline_microbatches)

    def term_weight(self) -> torch.Tensor:
        """The gradient a term of one micro-batch's objective carries, as `scaled_term`
        scales it (the MoE router losses attached to a stage's output use it)."""
        return self.scaled_term(torch.ones((), device=self.device))

    def prepare_stage(self, chunk: nn.Module) -> None:
        """Make a pipeline stage's forward run in `autocast`, timed as the step's forward
        (with gradients: a training forward, not the validation pass), and attach its MoE
        router losses to its output."""
        inner = getattr(chunk, "module", chunk)  # inside DDP, which calls it
        in_context(inner, self._stage_forward)
        attach_router_losses(inner, self.term_weight)

    def _stage_forward(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if torch.is_grad_enabled():
            stack.enter_context(self.state.phases.phase("forward"))
        stack.enter_context(self.autocast())
        return stack

    def timed(self, region: str) -> contextlib.AbstractContextManager:
        """A region of the step breakdown (`trainer/step/phases.py`)."""
        return self.state.phases.phase(region)
