"""Exact parameter counts and FLOPs per token for the Llama-style decoder.

Pure Python on the config, so the launcher's plan and the trainer's MFU use one definition.

Conventions (the same as `torch.utils.flop_counter.FlopCounterMode`):
- A matmul of (m x k) @ (k x n) costs 2*m*k*n FLOPs; only matmuls are counted
  (norms, rotary, softmax, SiLU and the elementwise product are a few percent and left out).
- Attention scores are counted over the full s x s square even though the mask is causal,
  as the math kernels compute it and as PaLM's MFU definition does.
- Backward costs twice the forward (a gradient for the input and one for the weight).
- A mixture-of-experts layer counts the router and the experts a token runs through (k routed
  plus the shared ones): FLOPs and active parameters follow those, total parameters count all
  N experts. Capacity dropping is not subtracted (MFU counts the model's nominal work).
- Multi-token prediction (models/mtp.py) counts, per depth, its projection of the 2 x dim
  concatenation to dim, its dense block and the shared LM head once more (its norms and the
  embedding lookup of the tokens ahead are not matmuls).
- Multi-head latent attention counts its latent projections (down to the latent, up to each
  head's key and value) and scores over query/key heads of nope + rope dims and value heads
  of v dims; its latent norms are parameters without FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.model_config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part of the model."""

    embedding: int
    per_layer: int
    """Parameters of a dense layer."""
    final_norm: int
    lm_head: int
    n_layers: int
    moe_layers: int = 0
    """Layers whose MLP is a mixture of experts."""
    moe_extra: int = 0
    """Parameters a MoE layer has beyond a dense one (router and experts replace the MLP)."""
    moe_active_extra: int = 0
    """The same counting only the experts one token runs through (k routed + shared)."""
    routed_experts_per_layer: int = 0
    """Parameters of the N routed experts of one MoE layer."""
    mtp: int = 0
    """Parameters of the multi-token prediction modules (each: three norms, the projection
    of [embedding; hidden] and a dense block; the embedding and head are shared)."""

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_layers + self.moe_layers * self.moe_extra

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.lm_head + self.mtp

    @property
    def active(self) -> int:
        """Parameters one token uses: the total less the routed experts it skips."""
        return self.total - self.moe_layers * (self.moe_extra - self.moe_active_extra)

    @property
    def experts(self) -> int:
        """Parameters of all routed experts (what expert parallelism shards)."""
        return self.moe_layers * self.routed_experts_per_layer

    @property
    def non_embedding(self) -> int:
        return self.layers + self.final_norm + self.mtp


def attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, norm weights and biases) of one attention layer."""
    h, heads = cfg.dim, cfg.n_heads
    if not cfg.is_mla:
        q, kv = heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        small = (2 * cfg.head_dim if cfg.qk_norm else 0) + (q + 2 * kv if cfg.attn_bias else 0)
        return 2 * h * q + 2 * h * kv, small
    q_rank, kv_rank = cfg.mla_q_rank, cfg.kv_rank
    q_width = heads * cfg.qk_head_dim
    queries = h * q_rank + q_rank * q_width if q_rank else h * q_width
    latent = h * (kv_rank + cfg.rope_dim) + kv_rank * heads * (cfg.nope_dim + cfg.v_head_dim)
    return queries + latent + heads * cfg.v_head_dim * h, q_rank + kv_rank


def mlp_matrices(cfg: ModelConfig) -> int:
    """Weight matrices of the dense MLP: SwiGLU's gate, up and down; GeLU's and squared
    ReLU's up and down."""
    return 3 if cfg.mlp == "swiglu" else 2


def count_params(cfg: ModelConfig) -> ParamCount:
    """Count every parameter of the model; a tied LM head adds none of its own."""
    h = cfg.dim
    attention = sum(attention_weights(cfg))
    mlp = mlp_matrices(cfg) * h * cfg.ffn_dim
    norms = 2 * h
    embedding = cfg.vocab_size * h
    expert = 3 * h * cfg.expert_ffn_dim
    router = h * cfg.moe_experts
    gate = h if cfg.moe_shared_gate and cfg.moe_shared_experts else 0
    shared = cfg.moe_shared_experts * expert + gate
    moe = router + cfg.moe_experts * expert + shared
    moe_active = router + cfg.moe_top_k * expert + shared
    per_mtp = 3 * h + 2 * h * h + attention + mlp + norms
    return ParamCount(
        embedding=embedding,
        per_layer=attention + mlp + norms,
        final_norm=h,
        lm_head=0 if cfg.tie_embeddings else cfg.vocab_size * h,
        n_layers=cfg.n_layers,
        moe_layers=cfg.n_moe_layers,
        moe_extra=moe - mlp,
        moe_active_extra=moe_active - mlp,
        routed_experts_per_layer=cfg.moe_experts * expert,
        mtp=cfg.mtp_layers * per_mtp,
    )


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token by part; training FLOPs follow from the backward convention."""

    attention_projections: int
    attention_scores: int
    mlp: int
    lm_head: int
    mtp: int = 0
    """The multi-token prediction modules: projection, dense block and LM head per depth."""
    attention_output: int = 0
    """Of `attention_projections`, the output projection (wo): what selective recompute
    runs again under tensor parallelism (parallel/recompute.py)."""
    routed_experts: int = 0
    """Of `mlp`, the routed experts' grouped GEMMs: what selective recompute runs again (it
    keeps no grouped GEMM's output)."""

    @property
    def forward(self) -> int:
        blocks = self.attention_projections + self.attention_scores + self.mlp
        return blocks + self.lm_head + self.mtp

    @property
    def train(self) -> int:
        """Forward + backward: the model FLOPs that MFU counts."""
        return 3 * self.forward

    def with_recompute(
        self, policy: str, recomputed_fraction: float = 1.0, tensor_parallel: bool = False
    ) -> int:
        """Training FLOPs including recomputation (what HFU counts).

        `full` re-runs the forward of the recomputed blocks; `selective` re-runs the
        attention scores and the routed experts, and under tensor parallelism
        (`tensor_parallel`: tp > 1) the attention's output projection too, whose partial sums
        it does not keep.
        `recomputed_fraction` is the share of blocks that recompute.
        """
        if policy == "full":
            blocks = self.attention_projections + self.attention_scores + self.mlp
            return self.train + round(blocks * recomputed_fraction)
        if policy == "selective":
            again = self.attention_scores + self.routed_experts
            again += self.attention_output if tensor_parallel else 0
            return self.train + round(again * recomputed_fraction)
        return self.train


def flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Forward FLOPs per token of a sequence of `seq_len` tokens (see module conventions)."""
    projections, scores, dense_mlp, moe_mlp = _block_terms(cfg, seq_len)
    n_layers, moe_layers = cfg.n_layers, cfg.n_moe_layers
    head = 2 * cfg.dim * cfg.vocab_size
    return FlopsPerToken(
        attention_projections=n_layers * projections,
        attention_scores=n_layers * scores,
        mlp=(n_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp,
        lm_head=head,
        mtp=mtp_flops_per_token(cfg, seq_len),
        attention_output=n_layers * _output_projection(cfg),
        routed_experts=moe_layers * cfg.moe_top_k * 3 * 2 * cfg.dim * cfg.expert_ffn_dim,
    )


def mtp_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of the multi-token prediction modules (0 without them)."""
    projections, scores, dense_mlp, _ = _block_terms(cfg, seq_len)
    per_depth = 2 * (2 * cfg.dim) * cfg.dim + projections + scores + dense_mlp
    return cfg.mtp_layers * (per_depth + 2 * cfg.dim * cfg.vocab_size)


def _output_projection(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one attention's output projection (wo): value heads to dim."""
    return 2 * cfg.n_heads * cfg.v_head_dim * cfg.dim


def _block_terms(cfg: ModelConfig, seq_len: int) -> tuple[int, int, int, int]:
    """One block's (attention projections, attention scores, dense MLP, MoE MLP) FLOPs."""
    h = cfg.dim
    projections = 2 * attention_weights(cfg)[0]
    # Q @ K^T and P @ V: each query meets seq_len keys in every head (a sliding window fewer).
    keys = min(seq_len, cfg.sliding_window) if cfg.sliding_window else seq_len
    scores = 2 * keys * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    mlp = mlp_matrices(cfg) * 2 * h * cfg.ffn_dim
    # A MoE layer: the router's logits plus the k routed and the shared experts' SwiGLUs
    # (and the shared experts' gate, one logit).
    experts = cfg.moe_top_k + cfg.moe_shared_experts
    gate = 2 * h if cfg.moe_shared_gate and cfg.moe_shared_experts else 0
    moe_mlp = 2 * h * cfg.moe_experts + experts * 3 * 2 * h * cfg.expert_ffn_dim + gate
    return projections, scores, mlp, moe_mlp
