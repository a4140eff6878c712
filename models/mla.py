"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1).

Keys and values are not projected per head from the hidden state: one low-rank latent c
(`kv_rank` wide, RMS-normed) is, and every head decompresses its key and value from it. The
rotary part of the key is decoupled: a `rope_dim`-wide key projected from the hidden state
and shared by all heads, concatenated to each head's position-free key. Queries are
projected directly (DeepSeek-V2-Lite) or through their own latent (`mla_q_rank` > 0):

    q = W_q x                      (or W_qb norm(W_qa x)) -> per head [q_nope | q_rope]
    [c | k_rope] = W_kva x;  [k_nope | v] = W_kvb norm(c) per head
    attention(q=[q_nope | rot(q_rope)], k=[k_nope | rot(k_rope)], v), scale 1/sqrt(nope+rope)

Under a scaled RoPE with `mscale_all_dim` (DeepSeek's YaRN configs) the scale is multiplied by
`softmax_mscale` as DeepSeek's attention does; the queries carry that factor, so every core
(SDPA, FlexAttention, context parallelism's ring) keeps its own 1/sqrt(nope + rope).

The rotary halves use this repo's half-split layout (models/layers.py). Like `Attention`, the
module infers its local heads from the projections' output shapes, so tensor parallelism
splits W_q (or W_qb), W_kvb column-wise and W_o row-wise, and leaves the small latent
projections and norms replicated (`parallel/tensor.py`). The rotary key passes through
`shared_key`, an identity here: it is where a key shared by all heads meets a rank's share
of them, so tensor parallelism sums its gradient over the ranks there. The causal core over
the decompressed per-head keys and values is `core`, which context parallelism swaps for
its ring (keys nope + rope wide, values v_dim: the scale 1/sqrt(nope + rope) is the ring's
own 1/sqrt of the query width).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from pretrain.core.model_config import ModelConfig
from pretrain.models.layers import (
    AttentionMask,
    AttentionProbe,
    CoreMask,
    RMSNorm,
    apply_rope,
    compiled_flex_attention,
)
from pretrain.models.rope import softmax_mscale


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention over `scaled_dot_product_attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, heads = cfg.dim, cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.nope_dim, cfg.rope_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_rank
        qk = self.nope + self.rope
        if cfg.mla_q_rank:
            self.wq_a = nn.Linear(h, cfg.mla_q_rank, bias=False)
            self.q_norm = RMSNorm(cfg.mla_q_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.mla_q_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(h, heads * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, h, bias=False)
        self.shared_key = nn.Identity()
        self.scale = qk**-0.5
        self.query_scale = softmax_mscale(cfg.rope_scaling)
        self.core = self._causal
        self.probe: AttentionProbe | None = None
        """As `Attention.probe`: handed the decompressed queries and keys."""

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        """Causal attention, or block-causal over packed documents under `mask` (as
        `pretrain.models.layers.document_mask` builds it)."""
        b, s, _ = x.shape
        q = self._queries(x).view(b, s, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.query_scale != 1:
            q = q * self.query_scale
        # One rotary key for all heads.
        k_rope = self.shared_key(apply_rope(k_rope.unsqueeze(2), cos, sin))
        k_rope = k_rope.expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.probe is not None:
            self.probe(q, k, mask, self.scale)
        if mask is None:
            out = self.core(q, k, v)
        elif isinstance(mask, CoreMask):
            out = self.core(q, k, v, mask)
        elif isinstance(mask, BlockMask):
            out = compiled_flex_attention()(q, k, v, block_mask=mask, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
