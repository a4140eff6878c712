"""A mixture-of-experts feed-forward: top-k router, N routed SwiGLU experts, shared experts.

Routing, per token: router logits -> softmax (or sigmoid) scores -> the k best experts,
their scores (optionally renormalized to sum to 1) weight the experts' outputs. Every
decision that could depend on which tokens share a rank is taken per sequence, so the model
computes the same function under any data- or expert-parallel layout:

- capacity: with `moe_capacity_factor` c > 0 an expert takes at most ceil(c * s * k / N)
  assignments of a sequence of s tokens, first come first served in (position, slot) order;
  a dropped assignment contributes 0 and the token's residual carries it on;
- the load-balancing loss (Switch/GShard form, N * sum_i f_i * P_i, with f_i the share of
  the sequence's k*s assignments routed to expert i before dropping and P_i its mean score)
  is computed per sequence and averaged over the sequences, like the token loss.

Experts are stored stacked (w1, w3: [N, f, h], w2: [N, h, f]) so expert parallelism shards
dim 0. The experts run through `dispatch(tokens_by_expert, counts)`; locally that is
`GroupedExperts`, and `parallel/expert.py` swaps in an all-to-all over the EP group.

Each forward leaves its weighted router losses in `aux_loss` for the trainer to add to the
loss, and accumulates detached routing statistics in `stats` for the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import FeedForward
from pretrain_core.model_config import ModelConfig


def _local(weight: torch.Tensor) -> torch.Tensor:
    # A parameter sharded by expert parallelism is a DTensor: compute on this rank's experts.
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    """N SwiGLU experts with stacked weights; runs tokens already grouped by expert."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [sum(counts), h]: counts[e] rows for each expert this module holds, in order."""
        # Cast like the rest of the block: FSDP's policy does not cover EP-sharded experts.
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if len(counts) != w1.shape[0]:
            raise ValueError(f"{len(counts)} token counts for {w1.shape[0]} local experts")
        # A loop of matmuls: every expert (even one without tokens) stays in the graph, so
        # data parallelism sees all parameters used in every step.
        outputs = [
            (F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T
            for e, chunk in enumerate(x.split(counts))
        ]
        return torch.cat(outputs)


def capacity(cfg: ModelConfig, seq_len: int) -> int | None:
    """Assignments one expert takes per sequence, or None when routing is dropless."""
    if cfg.moe_capacity_factor <= 0:
        return None
    return math.ceil(cfg.moe_capacity_factor * seq_len * cfg.moe_top_k / cfg.moe_experts)


def keep_mask(experts: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
    """Which assignments of experts [b, s, k] fit their expert's per-sequence capacity.

    Assignments queue per sequence in (position, slot) order; the first `limit` of each expert
    are kept. None keeps all.
    """
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    b = experts.shape[0]
    one_hot = F.one_hot(experts.reshape(b, -1), n_experts)  # [b, s*k, N]
    position = (one_hot.cumsum(1) * one_hot).sum(-1) - 1  # place in its expert's queue
    return (position < limit).view_as(experts)


def load_balancing_loss(
    scores: torch.Tensor, experts: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """N * sum_i f_i * P_i per sequence, averaged over sequences (1 when perfectly balanced).

    scores [b, s, N] are per-token probabilities over the experts; experts [b, s, k] the
    chosen ones; f_i counts assignments before any dropping.
    """
    b, s, k = experts.shape
    counts = F.one_hot(experts.reshape(b, -1), n_experts).sum(1).float()  # [b, N]
    fraction = counts / (s * k)
    probability = scores.mean(1)  # [b, N]
    return (n_experts * (fraction * probability).sum(-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of logsumexp(router logits)^2: keeps the router's logits small."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class RoutingStats:
    """Detached routing counts accumulated over forwards until read (for the metrics)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting anew."""
        self.totals: torch.Tensor | None = None
        self.forwards = 0

    @torch.no_grad()
    def add(
        self, routed: torch.Tensor, dropped: torch.Tensor, balance: torch.Tensor, z: torch.Tensor
    ) -> None:
        """Add one forward: assignments per expert [N], dropped ones, and the two losses."""
        # One float64 vector [N + 3], so reading it costs one reduction and no syncs before.
        row = torch.cat([routed.double(), torch.stack([dropped, balance, z]).double()])
        self.totals = row if self.totals is None else self.totals + row
        self.forwards += 1


class MoEFeedForward(nn.Module):
    """Router, routed experts and optional shared experts in place of the dense MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ffn = cfg.expert_ffn_dim
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, ffn)
        self.shared: nn.Module | None = None
        if cfg.moe_shared_experts:
            self.shared = FeedForward(cfg.dim, cfg.moe_shared_experts * ffn)
        self.dispatch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._local_dispatch
        self.aux_loss: torch.Tensor | None = None
        self.stats = RoutingStats()

    def _local_dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(x, counts.tolist())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k expert ids [b, s, k], their weights [b, s, k] and the router logits [b, s, N]."""
        cfg = self.cfg
        logits = self.router(x).float()
        scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(cfg.moe_top_k, dim=-1)
        if cfg.moe_normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape
        n = cfg.moe_experts
        experts, weights, logits = self.route(x)
        keep = keep_mask(experts, n, capacity(cfg, s))
        # The balance loss wants probabilities; sigmoid scores are normalized per token for it.
        scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        balance, zl = load_balancing_loss(probs, experts, n), z_loss(logits)
        self.aux_loss = cfg.moe_aux_loss_coef * balance + cfg.moe_z_loss_coef * zl
        self.stats.add(
            torch.bincount(experts.flatten(), minlength=n),
            (~keep).sum(),
            balance.detach(),
            zl.detach(),
        )

        k = cfg.moe_top_k
        tokens = x.reshape(-1, h)
        flat_keep = keep.flatten()
        expert_ids = experts.flatten()[flat_keep]
        token_ids = torch.arange(b * s, device=x.device).repeat_interleave(k)[flat_keep]
        gate = weights.flatten()[flat_keep]
        # Group the kept assignments by expert (stable: token order inside each expert).
        order = torch.argsort(expert_ids, stable=True)
        token_ids, gate = token_ids[order], gate[order]
        counts = torch.bincount(expert_ids, minlength=n)
        routed = self.dispatch(tokens[token_ids], counts)
        out = torch.zeros_like(tokens).index_add(0, token_ids, routed * gate[:, None].to(routed))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, h)


def moe_modules(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE feed-forwards, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def router_losses(model: nn.Module) -> torch.Tensor | None:
    """The sum of the weighted router losses of the last forward, or None for a dense model."""
    losses = [m.aux_loss for m in moe_modules(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
