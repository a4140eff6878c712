"""The model's shape as a typed dataclass: shared by recipes, the planner and the model."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain_core.choices import one_of

ARCHITECTURES = ("llama",)
MOE_ROUTERS = ("softmax", "sigmoid")


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""

    name: str = one_of("llama", ARCHITECTURES)
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
    moe_experts: int = 0
    """Routed experts N per mixture-of-experts layer; 0 makes every layer a dense SwiGLU MLP."""
    moe_top_k: int = 2
    """Routed experts each token runs through (k of N)."""
    moe_shared_experts: int = 0
    """Shared experts every token runs through besides its k routed ones (DeepSeek style)."""
    moe_ffn_dim: int = 0
    """Hidden size of one expert's SwiGLU; 0 means ffn_dim."""
    moe_layers: str = "all"
    """Which layers are MoE: all, every:K (layers K-1, 2K-1, ...) or after:N (all but the
    first N, which stay dense)."""
    moe_router: str = one_of("softmax", MOE_ROUTERS)
    """Router scores: softmax over the experts, or sigmoid per expert."""
    moe_normalize_topk: bool = True
    """Rescale the k selected scores of a token to sum to 1."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss N * sum_i f_i * P_i (per sequence, averaged)."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss: mean over tokens of logsumexp(router logits)^2."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert takes per sequence: ceil(factor * seq_len * k / N), later ones are
    dropped (their expert output is 0, the residual carries them); 0 = dropless."""

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden size of one routed or shared expert."""
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has a mixture-of-experts feed-forward."""
        if self.moe_experts <= 0:
            return False
        policy, _, arg = self.moe_layers.partition(":")
        if policy == "every":
            return index % int(arg) == int(arg) - 1
        if policy == "after":
            return index >= int(arg)
        return True

    @property
    def n_moe_layers(self) -> int:
        """How many layers are mixture-of-experts."""
        if self.moe_experts <= 0:
            return 0  # dense: asked for every stage of every layout the search tries
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads
