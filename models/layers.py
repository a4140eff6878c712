"""The layers the dense and the mixture-of-experts decoders share: RMSNorm, grouped-query
attention (rotary embeddings from models/rope.py) and the SwiGLU MLP (also a MoE layer's
shared expert)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretrain.core.model_config import ModelConfig
from pretrain.models.rope import apply_rope


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class CoreMask:
    """A mask the attention core applies itself, handed to it as a fourth argument: context
    parallelism's documents, whose keys travel between ranks (parallel/ring_attention.py)."""


AttentionMask = torch.Tensor | BlockMask | CoreMask | None
"""None: causal. A boolean [b, 1, s, s] (True = may attend), a FlexAttention BlockMask, or a
mask the swapped-in core applies."""

AttentionProbe = Callable[[torch.Tensor, torch.Tensor, AttentionMask, float], None]
"""Handed an attention's (queries, keys, mask, scale) before its core runs."""


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor | BlockMask:
    """Block-causal mask of packed documents: position i attends to positions j <= i with
    doc_ids[:, j] == doc_ids[:, i]. On CUDA a FlexAttention BlockMask (blocks outside the
    documents are skipped), elsewhere a boolean mask for scaled_dot_product_attention."""
    b, s = doc_ids.shape
    if doc_ids.device.type == "cuda":

        def same_document(batch, _head, q_index, kv_index):
            return (doc_ids[batch, q_index] == doc_ids[batch, kv_index]) & (q_index >= kv_index)

        return create_block_mask(same_document, b, None, s, s, device=doc_ids.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Sliding-window causal mask [1, 1, s, s]: position i attends to j with
    i - window < j <= i, as transformers' sliding-window mask has it."""
    i = torch.arange(seq_len, device=device)
    offset = i[:, None] - i[None, :]
    return ((offset >= 0) & (offset < window))[None, None]


@functools.cache
def compiled_flex_attention():
    # Fused only when compiled; eager flex_attention materializes the whole score matrix.
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d] under `mask`."""
    if isinstance(mask, BlockMask):
        return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )


LOGIT_TILE_ELEMENTS = 1 << 24
"""Scores `max_logit` holds at once (64 MiB in FP32), whatever the sequence length."""


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, scale: float) -> torch.Tensor:
    """The largest attention logit (scale x q.k, the softmax's input) of q [b, heads, s, d]
    over k [b, kv_heads, s, d] among the pairs `mask` lets attend: exact under the causal
    mask and a boolean one; a FlexAttention BlockMask or a core's own mask counts the causal
    pairs (a bound from above). Computed over tiles of query rows, in FP32."""
    q, k = q.detach().float(), k.detach().float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    b, heads, s, _ = q.shape
    rows = max(1, LOGIT_TILE_ELEMENTS // (b * heads * s))
    best = torch.full((), float("-inf"), device=q.device)
    for row in range(0, s, rows):
        scores = (q[:, :, row : row + rows] @ k.transpose(-1, -2)) * scale
        if isinstance(mask, torch.Tensor):
            allowed = mask[..., row : row + rows, :]
        else:
            positions = torch.arange(s, device=q.device)
            allowed = positions[None, :] <= positions[row : row + rows, None]
        best = torch.maximum(best, scores.masked_fill(~allowed, float("-inf")).amax())
    return best


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Grouped-query self-attention: causal, or block-causal over packed documents. The
    causal core is `causal_attention` unless a parallel layout swaps in another with the
    same signature (context parallelism's ring, which also takes its documents as a
    `CoreMask`).

    Options of public families: biases on wq/wk/wv (`attn_bias`, Qwen2) and an RMSNorm over
    each query and key head before the rotary embedding (`qk_norm`, Qwen3). Tensor
    parallelism sets `per_head`, through which the per-head norms' weights pass, to sum
    their gradient over the ranks' heads. A stability monitor sets `probe`, which is handed
    the queries, keys, mask and scale of each forward (None: nothing is handed)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_width, bias=cfg.attn_bias)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=cfg.attn_bias)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=cfg.attn_bias)
        self.wo = nn.Linear(q_width, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = causal_attention
        self.per_head: Callable[[torch.Tensor], torch.Tensor] = _same
        self.probe: AttentionProbe | None = None

    def _norm(self, norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:
            return x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
        return normed.type_as(x) * self.per_head(norm.weight)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, whatever share of the heads this rank's wq/wk/wv hold.
        q = self._norm(self.q_norm, self.wq(x).view(b, s, -1, self.head_dim))
        k = self._norm(self.k_norm, self.wk(x).view(b, s, -1, self.head_dim))
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.probe is not None:
            self.probe(q, k, mask, self.head_dim**-0.5)
        if mask is None:
            out = self.core(q, k, v)
        elif isinstance(mask, CoreMask):
            out = self.core(q, k, v, mask)
        else:
            out = attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _same(weight: torch.Tensor) -> torch.Tensor:
    return weight


class FeedForward(nn.Module):
    """The MLP: SwiGLU w2(silu(w1 x) * w3 x), or with one input projection GeLU
    w2(gelu(w1 x)) (tanh approximation, as GPT-2/3 and BLOOM) or squared ReLU
    w2(relu(w1 x)^2) (So et al. 2021, "Primer"; Nemotron-4)."""

    def __init__(self, dim: int, ffn_dim: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        if kind == "swiglu":
            self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        if self.kind == "relu2":
            return self.w2(torch.square(F.relu(self.w1(x))))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
