"""Multi-token prediction (DeepSeek-V3, section 2.2): D sequential modules after the last
block, the k-th predicting from position i the token at i + k + 1.

Depth k takes the previous depth's hidden state h (the last block's, before the final norm,
for k = 1) and the embedding of the token k positions ahead, normalizes each, projects
their concatenation [embedding; hidden] back to dim (`eh_proj`), runs one transformer block
and normalizes its output for the shared LM head. Its hidden state (before that norm) feeds
depth k + 1. The sequence keeps its length: the tokens ahead are the input rolled left by
k, so the last k positions see tokens from the sequence's start and their targets are left
out of the loss (trainer/step/mtp_loss.py); causal attention keeps them from reaching any
earlier position. The block attends under the model's mask (documents, window) and rotary
positions; it is dense, with the model's MLP, also in a mixture-of-experts model (where
DeepSeek-V3's MTP block is a MoE layer).

Each module returns (hidden, normalized) from its own forward, so a wrapper around it
(FSDP2's unit, tensor parallelism's plan) sees every parameter used inside that call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pretrain.core.model_config import ModelConfig
from pretrain.models.layers import AttentionMask, RMSNorm


class MTPModule(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a transformer block and its final norm."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden state, its normalized output for the LM head)."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        out = self.block(self.eh_proj(joined), cos, sin, mask=mask)
        return out, self.norm(out)


def mtp_modules(cfg: ModelConfig, block: Callable[[], nn.Module]) -> nn.ModuleDict | None:
    """The model's `cfg.mtp_layers` depths keyed "0", "1", ... (None without MTP), each
    around a transformer block `block()` builds."""
    if not cfg.mtp_layers:
        return None
    return nn.ModuleDict({str(k): MTPModule(cfg, block()) for k in range(cfg.mtp_layers)})


def tokens_ahead(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """The token `depth` positions after each position of `tokens` [b, s] (rolled around: the
    last `depth` positions get the first tokens, which no loss reads)."""
    return tokens.roll(-depth, dims=1)


def predict_ahead(
    modules: nn.ModuleDict,
    embedding: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: AttentionMask = None,
) -> list[torch.Tensor]:
    """Each depth's normalized output, in order, from the last block's hidden state and the
    input `tokens` [b, s]."""
    outputs = []
    for depth, module in enumerate(modules.values(), start=1):
        hidden, normed = module(hidden, embedding(tokens_ahead(tokens, depth)), cos, sin, mask)
        outputs.append(normed)
    return outputs
