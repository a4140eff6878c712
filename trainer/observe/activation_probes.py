"""What the forward of a sampled step shows (`trainer/observe/stability.py`): the RMS of each
block's output, the largest attention logit of each layer and the output logits' z-mean.

Hooks are installed once and do nothing until `armed`; they count every training forward of
the step (all of its micro-batches, so the values are those of the global batch under any
layout), and none run in backward (the recomputed forwards of activation checkpointing and
of a chunked loss).

- Block output RMS: sqrt(sum h^2 / count) over every element of every token. A tensor
  parallel rank's block output is replicated over tp without sequence parallelism (each
  rank adds 1/tp of it) and its own sequence shard with it; data, context and pipeline
  ranks hold different tokens or layers.
- Largest attention logit: the largest scale x q.k (the softmax's input) over the pairs the
  mask lets attend, exact: `models.layers.max_logit` over the queries and keys the attention
  hands its `probe` (tensor parallel ranks hold their heads), or under context parallelism
  the ring's own tile scores (every key chunk of the ring). With a CUDA document mask
  (FlexAttention) it is the largest over the causal pairs, a bound from above. It costs
  about one more QK^T per sampled step, in tiles.
- z-mean: the mean over tokens of logsumexp(logits)^2 (what the z-loss penalises), the
  log-sum-exp taken over the whole vocabulary (over the tp ranks' shards under tensor
  parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pretrain.models.layers import AttentionMask, max_logit
from pretrain.trainer.step.phases import StepPhases


def in_backward() -> bool:
    """Whether the autograd engine is running (a forward recomputed in backward)."""
    return torch._C._current_graph_task_id() != -1


class LogitProbe:
    """Shared by every attention: keeps the largest logit of the last one that ran, which
    the hook of its block (running right after) takes. One object for all layers, so a
    compiled block needs no guard per layer."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, scale: float) -> None:
        self.value = max_logit(q, k, mask, scale)

    def record(self, value: torch.Tensor) -> None:
        """A core's own largest logit (context parallelism's ring)."""
        self.value = value

    def take(self) -> torch.Tensor | None:
        value, self.value = self.value, None
        return value


class ActivationProbes:
    """Forward hooks on the blocks and the LM head of each model view, and their sums."""

    def __init__(
        self,
        views: list[nn.Module],
        n_layers: int,
        *,
        tp: int,
        sp: bool,
        tp_group: dist.ProcessGroup | None,
        device: torch.device,
        phases: StepPhases,
    ) -> None:
        self.n_layers = n_layers
        self.tp, self.tp_group = tp, tp_group
        # A replicated block output counts 1/tp on each tensor parallel rank.
        self.block_weight = 1.0 / tp if tp > 1 and not sp else 1.0
        self.device, self.phases = device, phases
        self.armed = False
        self.logits = LogitProbe()
        self.attentions: list[nn.Module] = []
        for view in views:
            for key, block in view.layers.items():
                block.register_forward_hook(self._block_hook(int(key)))
                self.attentions.append(block.attention)
            if getattr(view, "output", None) is not None:
                view.output.register_forward_hook(self._head_hook)
        self.reset()

    def reset(self) -> None:
        """Zero the sums (before a sampled step)."""
        zeros = torch.zeros(self.n_layers, dtype=torch.float64, device=self.device)
        self.act_squares, self.act_count = zeros.clone(), zeros.clone()
        self.logit_max = torch.full_like(zeros, float("-inf"))
        self.z_sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def arm(self, on: bool) -> None:
        """Start (or stop) counting; the attentions hand their queries and keys meanwhile."""
        self.armed = on
        for attention in self.attentions:
            core = attention.core
            if hasattr(core, "probe"):  # context parallelism's ring computes the scores
                core.probe = self.logits.record if on else None
            else:
                attention.probe = self.logits if on else None
        self.logits.value = None

    def _block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not self.armed or in_backward():
                return
            with torch.no_grad(), self.phases.phase("stability", within=True):
                h = output.to_local() if isinstance(output, DTensor) else output
                h = h.detach().float()
                self.act_squares[index] += self.block_weight * h.pow(2).sum().double()
                self.act_count[index] += self.block_weight * h.numel()
                logit = self.logits.take()
                if logit is not None:
                    self.logit_max[index] = torch.maximum(self.logit_max[index], logit.double())

        return hook

    def _head_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self.armed or in_backward():
            return
        with torch.no_grad(), self.phases.phase("stability", within=True):
            sharded = isinstance(output, DTensor) and self.tp > 1
            x = (output.to_local() if isinstance(output, DTensor) else output).detach().float()
            top = x.amax(-1)
            if sharded:
                dist.all_reduce(top, dist.ReduceOp.MAX, group=self.tp_group)
            total = (x - top.unsqueeze(-1)).exp().sum(-1)
            if sharded:
                dist.all_reduce(total, group=self.tp_group)
            lse = top + total.log()
            # After the vocab reduction every tensor parallel rank holds the same values.
            sums = torch.stack([lse.pow(2).sum(), lse.new_tensor(lse.numel())]).double()
            self.z_sums += sums / self.tp
