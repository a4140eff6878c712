"""What crosses between pipeline stages, derived from the recipe, so no stage infers it.

Given no shapes, torch's `PipelineStage` learns them at the first step: after a vote over
the pipeline on whether every stage knows its shapes (a few bytes), each stage runs a
forward of the first micro-batch and sends the next its outputs' metadata as pickled
objects (and the gradients' back). Every shape follows from the recipe, so each stage is
given examples of its inputs and outputs here (on the meta device: no storage); the vote
then finds them all known and the first step starts with real work. A batch-size ramp or a
sequence-length warm-up changes them between stages: the pipelined step builds its schedule
again, with the stage's shapes, when a step's differ (`trainer/step/pipeline.py`).

Per micro-batch of the schedule, on this rank:

- the first stage takes token ids [b, s / cp] (int64);
- between stages, hidden states [b, s / cp, dim], or [b, s / (cp tp), dim] under sequence
  parallelism (the residual stream leaves a block sequence-sharded), as plain tensors (the
  TP plan hands back local ones), in FSDP's compute dtype where it casts the weights, else
  in fp32 (autocast computes in low precision, but the residual adds stay in the weights'
  fp32);
- the last stage returns this rank's local logits [b, s / cp, vocab / tp] (the padded
  vocabulary) or, when the loss applies the head (`train.loss_chunks` > 1), the final
  norm's output, shaped as hidden states; with multi-token prediction the modules' outputs
  follow along the batch, (1 + mtp_layers) b sequences. torch sends the last stage's output
  nowhere and reads only that it exists; its example is this rank's local part even where
  the value is a DTensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.core.layout import Degrees, grad_accum_steps, uses_fsdp
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.precision import compute_dtype
from pretrain.parallel.tensor import padded_vocab


@dataclass(frozen=True)
class StageShapes:
    """The tensors one micro-batch of the schedule carries between this rank's stages."""

    batch: int
    """Sequences per micro-batch of the schedule."""
    tokens: int
    """Positions of each sequence this rank holds (the sequence over cp)."""
    hidden_tokens: int
    """Positions of each sequence in the hidden states between stages (over tp under SP)."""
    dim: int
    """Model width."""
    hidden_dtype: torch.dtype
    """dtype of the hidden states between stages."""
    head_width: int
    """Last dim of the last stage's output: the local vocabulary, or dim when the loss
    applies the head."""
    head_tokens: int
    """Positions of each sequence in the last stage's output."""
    head_dtype: torch.dtype
    """dtype of the last stage's output."""
    head_batch: int = 0
    """Sequences in the last stage's output: `batch`, times 1 + mtp_layers with multi-token
    prediction (0: `batch`)."""

    def examples(
        self, stage: int, n_stages: int
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Example inputs and outputs of pipeline stage `stage` of `n_stages`, on meta."""
        hidden = self._meta((self.batch, self.hidden_tokens, self.dim), self.hidden_dtype)
        if stage == 0:
            inputs = self._meta((self.batch, self.tokens), torch.int64, grad=False)
        else:
            inputs = hidden
        if stage == n_stages - 1:
            shape = (self.head_batch or self.batch, self.head_tokens, self.head_width)
            outputs = self._meta(shape, self.head_dtype)
        else:
            outputs = hidden
        return (inputs,), (outputs,)

    @staticmethod
    def _meta(shape: tuple[int, ...], dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def stage_shapes(
    cfg: RecipeConfig,
    degrees: Degrees,
    n_microbatches: int,
    sequences: int | None = None,
    seq_len: int | None = None,
) -> StageShapes:
    """The shapes of `cfg`'s pipeline stages when each rank's batch (micro_batch times the
    accumulation count, or `sequences` of `seq_len` under a ramp's stage) runs as
    `n_microbatches` micro-batches of the schedule."""
    if sequences is None:
        sequences = cfg.train.micro_batch * grad_accum_steps(cfg)
    tokens = (seq_len or cfg.train.seq_len) // degrees.cp
    sp = cfg.parallel.sp and degrees.tp > 1
    hidden_tokens = tokens // degrees.tp if sp else tokens
    low = compute_dtype(cfg.precision)
    hidden_dtype = low if low is not None and uses_fsdp(cfg.parallel, degrees) else torch.float32
    if cfg.train.loss_chunks > 1:
        head = (cfg.model.dim, hidden_tokens, hidden_dtype)
    else:
        # The head all-gathers the sequence under SP; its output is in the compute dtype.
        vocab = padded_vocab(cfg.model.vocab_size, degrees.tp) // degrees.tp
        head = (vocab, tokens, low or torch.float32)
    return StageShapes(
        head_batch=sequences // n_microbatches * (1 + cfg.model.mtp_layers),
        batch=sequences // n_microbatches,
        tokens=tokens,
        hidden_tokens=hidden_tokens,
        dim=cfg.model.dim,
        hidden_dtype=hidden_dtype,
        head_width=head[0],
        head_tokens=head[1],
        head_dtype=head[2],
    )
