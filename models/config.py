"""The model's shape as a typed dataclass: shared by recipes, the planner and the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""

    name: str = "llama"
    """Architecture family; only `llama` (the decoder in models/llama.py) exists."""
    vocab_size: int = 4096
    """Tokenizer vocabulary size; the embedding and LM head have this many rows."""
    dim: int = 128
    """Hidden size h."""
    n_layers: int = 4
    """Number of transformer blocks L."""
    n_heads: int = 4
    """Attention (query) heads a; head_dim = dim / n_heads."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means n_heads (plain multi-head)."""
    ffn_dim: int = 384
    """Hidden size of the SwiGLU MLP (the gate and up projections' output width)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables are built for; train.seq_len must not exceed it."""
    rope_theta: float = 10000.0
    """Rotary embedding base (Llama 3 uses 500000)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal init; output projections are scaled by 1/sqrt(2L)."""

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads
