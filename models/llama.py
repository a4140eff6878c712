"""A Llama-style decoder in plain single-device PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP with
pre-norm residuals. Parallelism is applied from outside (see `parallel/`), which is why:
- blocks live in a `ModuleDict` keyed by layer index, so a pipeline stage can drop
  blocks and keep the parameter names of the ones it holds;
- attention reads the number of local heads from the projections' output shapes, so
  tensor parallelism can shard wq/wk/wv column-wise without touching this file;
- a stage may set `tok_embeddings`, `norm` or `output` to None and `forward` adapts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.moe import MoEFeedForward


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


class Attention(nn.Module):
    """Causal grouped-query self-attention over `scaled_dot_product_attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wo = nn.Linear(q_width, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, whatever share of the heads this rank's wq/wk/wv hold.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h)).

    The MLP is a mixture of experts (models/moe.py) on the layers `cfg.is_moe_layer` picks.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            MoEFeedForward(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg.dim, cfg.ffn_dim)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: token embedding, `cfg.n_layers` blocks, final norm and LM head."""

    sequence_shards: int = 1
    """Parts the input's sequence arrives split into: a pipeline stage after the first under
    sequence parallelism receives 1/tp of each sequence's hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._tie_head()
        # Derived from the config, so not saved in checkpoints (persistent=False).
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _tie_head(self) -> None:
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary tables on `device` (default: where they are now).

        Needed after `to_empty`, which leaves buffers uninitialized.
        """
        device = self.rope_cos.device if device is None else device
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_tables(
            cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device
        )

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        """Move to `device` without initializing, keeping a tied head tied.

        `nn.Module.to_empty` from meta replaces each parameter with a new object, which
        would silently untie the LM head from the embedding.
        """
        super().to_empty(device=device, recurse=recurse)
        self._tie_head()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s].

        A pipeline stage without `tok_embeddings` takes hidden states [b, s, dim] instead;
        one without `output` returns hidden states.
        """
        # The input's length, not the embedding's: sequence parallelism may shard the latter.
        seq_len = tokens.shape[1] * self.sequence_shards
        if seq_len > self.rope_cos.shape[0]:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_on_meta(cfg: ModelConfig) -> Transformer:
    """Construct the model on the meta device: shapes only, no storage, no initialization."""
    with torch.device("meta"):
        return Transformer(cfg)
