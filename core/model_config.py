"""The model's shape as a typed dataclass: shared by recipes, the planner and the model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from pretrain.core.choices import one_of

ARCHITECTURES = ("llama",)
ATTENTIONS = ("gqa", "mla")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_GEMMS = ("grouped", "loop")
MOE_BALANCES = ("aux", "bias", "both")
MLPS = ("swiglu", "gelu", "relu2")


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
    """Attention (query) heads a; each head_dim wide."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means n_heads (plain multi-head)."""
    attention: str = one_of("gqa", ATTENTIONS)
    """gqa (grouped-query attention over n_kv_heads) or mla (DeepSeek-V2's multi-head latent
    attention: keys and values decompressed per head from a shared low-rank latent, plus a
    decoupled rotary key shared by all heads; models/mla.py)."""
    head_dim: int = 0
    """Width of one attention head; 0 means dim / n_heads (Qwen3 and Gemma set it apart: the
    query width n_heads x head_dim need not be dim). Read back, it is always the width."""
    qk_norm: bool = False
    """RMSNorm (model.norm_eps, a weight per head dim) over each query and key head before
    the rotary embedding, as Qwen3 has."""
    attn_bias: bool = False
    """Biases on the query, key and value projections (not the output one), as Qwen2 has."""
    sliding_window: int = 0
    """Each token attends to itself and the sliding_window - 1 tokens before it (Mistral's
    sliding-window attention); 0 attends to every earlier token."""
    mla_q_rank: int = 0
    """MLA: rank of the compressed query (DeepSeek-V2: 1536); 0 projects queries directly from
    the hidden state (DeepSeek-V2-Lite)."""
    mla_kv_rank: int = 0
    """MLA: rank of the key/value latent; 0 means 4 x head_dim (DeepSeek-V2: 512)."""
    mla_rope_dim: int = 0
    """MLA: rotary dims of each query and of the shared rotary key; 0 means head_dim / 2
    (DeepSeek-V2: 64)."""
    mla_nope_dim: int = 0
    """MLA: dims of each query and key head without rotary position; 0 means head_dim
    (DeepSeek-V2: 128)."""
    mla_v_dim: int = 0
    """MLA: dims of each value head; 0 means head_dim (DeepSeek-V2: 128)."""
    ffn_dim: int = 384
    """Hidden size of the MLP (SwiGLU: the gate and up projections' output width)."""
    mlp: str = one_of("swiglu", MLPS)
    """The dense MLP: swiglu (w2(silu(w1 x) * w3 x), Llama), gelu (w2(gelu(w1 x)), GPT-3
    and BLOOM) or relu2 (w2(relu(w1 x)^2), Nemotron-4); experts stay SwiGLU."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables are built for; train.seq_len must not exceed it."""
    rope_theta: float = 10000.0
    """Rotary embedding base (Llama 3 uses 500000)."""
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """Rotary frequency scaling as a Hugging Face config.json states it: `rope_type` llama3
    (with factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), yarn
    (factor, original_max_position_embeddings; optional beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor, truncate), linear (factor) or dynamic (factor); empty
    means plain RoPE."""
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
    moe_balance: str = one_of("aux", MOE_BALANCES)
    """Load balancing: aux (the load-balancing loss, weighted by moe_aux_loss_coef), bias
    (DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the routing scores picks
    the experts, nudged after every step towards the mean load; the loss is still reported,
    not trained on) or both (the bias and the loss)."""
    moe_bias_rate: float = 1e-3
    """moe_balance=bias|both: the bias step per optimizer step (gamma in DeepSeek-V3): each
    expert's bias moves by it towards balance, up when under the mean load, down when over.
    Keep it well below the spread of the router's scores (softmax scores of many experts are
    close to 1/N at first), or the loads swing from step to step instead of settling."""
    moe_node_limit: int = 0
    """Node-limited routing (DeepSeek-V3's group-limited top-k): each token's k experts come
    from at most this many nodes of the ep group. The experts are split into one group per
    node the ep group spans (cluster.gpus_per_node ranks each; one group when ep fits in a
    node); each group scores the sum of its two best affinities, the best moe_node_limit
    groups are kept and the top-k is taken among their experts. 0 = off."""
    moe_groups: int = 0
    """Expert groups of group-limited routing, fixed by the model (DeepSeek-V3's n_group, with
    moe_node_limit its topk_group): the experts form this many contiguous groups whatever the
    layout. 0 means one group per node the ep group spans (node-limited routing, above)."""
    moe_route_scale: float = 1.0
    """Factor on the routed experts' weights after the top-k (and its renormalization), not
    on the shared experts' (DeepSeek's routed_scaling_factor: V2 16, V3 2.5)."""
    moe_shared_gate: bool = False
    """A sigmoid gate on the shared experts' output, sigmoid(w . x) with one weight per hidden
    unit (Qwen2-MoE's shared_expert_gate); without it the shared experts are added as they are."""
    mtp_layers: int = 0
    """Multi-token prediction (DeepSeek-V3's MTP modules, Megatron's --mtp-num-layers): D
    modules after the last block, the k-th predicting the token k + 1 positions after the next
    one. Each normalizes the embedding of the token k positions ahead and the previous depth's
    hidden state (the last block's for k = 1), projects their concatenation back to dim,
    runs one transformer block (dense, with the model's MLP) and its own final norm, and
    shares the embedding and the LM head with the model; models/mtp.py. 0 = off."""
    mtp_loss_weight: float = 0.1
    """Weight of the MTP loss: the mean over the D depths of each depth's cross-entropy,
    times this, is added to the objective (DeepSeek-V3: 0.3 for its first 10T tokens, then
    0.1; Megatron's default 0.1). The reported loss stays the next-token loss."""
    moe_gemm: str = one_of("grouped", MOE_GEMMS)
    """How the experts compute: grouped (one `torch._grouped_mm` per projection over all local
    experts, no host sync; falls back to the loop where the device lacks the kernel for the
    dtype) or loop (one matmul per expert, the reference path for debugging)."""

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads (MLA decompresses one per query head)."""
        if self.attention == "mla":
            return self.n_heads
        return self.n_kv_heads or self.n_heads

    @property
    def explicit_head_dim(self) -> int:
        """model.head_dim as the recipe gives it (0: dim / n_heads)."""
        return int(vars(self)["_head_dim"])

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.attention == "mla"

    @property
    def kv_rank(self) -> int:
        """MLA: rank of the key/value latent."""
        return self.mla_kv_rank or 4 * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotary part of a query (and key) head: all of it under GQA."""
        if not self.is_mla:
            return self.head_dim
        return self.mla_rope_dim or self.head_dim // 2

    @property
    def nope_dim(self) -> int:
        """MLA: width of the position-free part of a query and key head."""
        return self.mla_nope_dim or self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and key) head."""
        return self.nope_dim + self.rope_dim if self.is_mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Width of one value head."""
        return (self.mla_v_dim or self.head_dim) if self.is_mla else self.head_dim

    @property
    def balance_loss(self) -> bool:
        """Whether the load-balancing loss is part of the objective."""
        return self.moe_balance in ("aux", "both")

    @property
    def balance_bias(self) -> bool:
        """Whether routing adds the aux-loss-free per-expert bias."""
        return self.moe_experts > 0 and self.moe_balance in ("bias", "both")

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
        return _moe_layer_count(self.moe_layers, self.n_layers)


@functools.lru_cache(maxsize=1024)
def _moe_layer_count(policy: str, n_layers: int) -> int:
    # Cached: the layout search asks it of every stage of tens of thousands of layouts.
    probe = ModelConfig(n_layers=n_layers, moe_experts=1, moe_layers=policy)
    return sum(probe.is_moe_layer(i) for i in range(n_layers))


def _head_dim(self: ModelConfig) -> int:
    """Width of one attention head: model.head_dim, or dim / n_heads when that is 0 (0 for
    a head count validation refuses)."""
    return self.explicit_head_dim or (self.dim // self.n_heads if self.n_heads > 0 else 0)


def _set_head_dim(self: ModelConfig, value: int) -> None:
    vars(self)["_head_dim"] = value


# model.head_dim is a field (the recipe's value, 0 by default) that reads back as the width
# the planner and the model use; the dataclass's __init__ assigns it through the setter.
ModelConfig.head_dim = property(_head_dim, _set_head_dim)  # type: ignore[assignment]
