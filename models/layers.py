"""The layers the dense and the mixture-of-experts decoders share: RMSNorm, rotary position
embeddings, grouped-query attention and the SwiGLU MLP (also a MoE layer's shared expert)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretrain_core.model_config import ModelConfig


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


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of each (position, frequency): two float32 [max_seq_len, head_dim // 2]."""
    # float64 angles: they reach max_seq_len radians, where float32 rounding shows in the tables.
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, head_dim] by position, in the half-split layout.

    The first and second halves of each head form the (real, imaginary) pairs, as in the
    Hugging Face Llama layout, so exported weights need no permutation.
    """
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


AttentionMask = torch.Tensor | BlockMask | None
"""None: causal. A boolean [b, 1, s, s] (True = may attend) or a FlexAttention BlockMask."""


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Grouped-query self-attention: causal, or block-causal over packed documents. The
    causal core is `causal_attention` unless a parallel layout swaps in another with the
    same signature (context parallelism's ring, which takes no document mask)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wo = nn.Linear(q_width, cfg.dim, bias=False)
        self.core = causal_attention

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, whatever share of the heads this rank's wq/wk/wv hold.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v) if mask is None else attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


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
