"""A Llama-style decoder in plain single-device PyTorch.

RMSNorm, rotary position embeddings, grouped-query (or multi-head latent, models/mla.py)
attention and an MLP (SwiGLU, GeLU or squared ReLU: `model.mlp`) with pre-norm residuals.
Parallelism is applied from outside (see `parallel/`), which is why:
- blocks live in a `ModuleDict` keyed by layer index, so a pipeline stage can drop
  blocks and keep the parameter names of the ones it holds;
- attention reads the number of local heads from the projections' output shapes, so
  tensor parallelism can shard wq/wk/wv column-wise without touching this file;
- a stage may set `tok_embeddings`, `norm` or `output` to None and `forward` adapts;
- context parallelism feeds a rank chunks of each sequence that are not contiguous, and sets
  `positions` so the rotary tables follow the tokens' global positions, and `documents` so
  its ring masks packed documents.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pretrain.core.model_config import ModelConfig
from pretrain.models.layers import (
    Attention,
    AttentionMask,
    FeedForward,
    RMSNorm,
    document_mask,
    window_mask,
)
from pretrain.models.mla import MultiHeadLatentAttention
from pretrain.models.moe import MoEFeedForward, moe_modules
from pretrain.models.mtp import mtp_modules, predict_ahead
from pretrain.models.rope import rope_tables


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h)).

    The MLP is a mixture of experts (models/moe.py) on the layers `cfg.is_moe_layer` picks;
    `index` None makes it dense (a multi-token prediction module's block).
    """

    def __init__(self, cfg: ModelConfig, index: int | None = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention: nn.Module = MultiHeadLatentAttention(cfg) if cfg.is_mla else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            MoEFeedForward(cfg)
            if index is not None and cfg.is_moe_layer(index)
            else FeedForward(cfg.dim, cfg.ffn_dim, cfg.mlp)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        # The mask goes by keyword: tensor parallelism's input plan covers (x, cos, sin).
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: token embedding, `cfg.n_layers` blocks, final norm and LM head, and
    `cfg.mtp_layers` multi-token prediction modules (models/mtp.py) sharing the last two."""

    sequence_shards: int = 1
    """Parts the input's sequence arrives split into: a pipeline stage after the first under
    sequence parallelism receives 1/tp of each sequence's hidden states."""
    positions: Callable[[int, torch.device], torch.Tensor] | None = None
    """Global positions of the tokens this rank holds, given their count and device (set by
    context parallelism); None means 0 .. s-1."""
    documents: Callable[[torch.Tensor], AttentionMask] | None = None
    """The attention mask of the documents of this rank's positions [b, s] (set by context
    parallelism, whose ring masks them itself); None means `document_mask`."""

    keeps_embedding_copy: bool = False
    """This pipeline stage holds a copy of the first stage's embedding for its multi-token
    prediction modules (parallel/pipeline/tied_embedding.py keeps the two alike)."""
    head_in_loss: bool = False
    """The loss applies the LM head (in chunks, `train.loss_chunks`): forward returns the
    final norm's output instead of the logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp: nn.ModuleDict | None = mtp_modules(cfg, lambda: TransformerBlock(cfg, None))
        self._tie_head()
        # Derived from the config, so not saved in checkpoints (persistent=False).
        cos, sin = rope_tables(
            cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, None, cfg.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _tie_head(self) -> None:
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary tables on `device` (default: where they are now) and zero
        the experts' balancing biases.

        Needed after `to_empty`, which leaves buffers uninitialized.
        """
        device = self.rope_cos.device if device is None else device
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_tables(
            cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, device, cfg.rope_scaling
        )
        for moe in moe_modules(self):
            moe.reset_bias()

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        """Move to `device` without initializing, keeping a tied head tied.

        `nn.Module.to_empty` from meta replaces each parameter with a new object, which
        would silently untie the LM head from the embedding.
        """
        super().to_empty(device=device, recurse=recurse)
        self._tie_head()
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s]; with `doc_ids` [b, s] (the document of
        each position) attention stays inside each document.

        A pipeline stage after the first (without `tok_embeddings`, or with the copy the MTP
        modules use) takes hidden states [b, s, dim] instead;
        one without `output` (or whose loss applies it) returns hidden states. Given the
        input token ids as `mtp_tokens`, a model (or last stage) with multi-token prediction
        modules appends their outputs along the batch: [(1 + mtp_layers) b, s, ...], the
        next-token part first.
        """
        # The input's length, not the embedding's: sequence parallelism may shard the latter.
        seq_len = tokens.shape[1] * self.sequence_shards
        if seq_len > self.rope_cos.shape[0]:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        if self.positions is None:
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        else:
            index = self.positions(seq_len, self.rope_cos.device)
            cos, sin = self.rope_cos[index], self.rope_sin[index]
        first = self.tok_embeddings is not None and not self.keeps_embedding_copy
        h = self.tok_embeddings(tokens) if first else tokens
        mask = None
        if doc_ids is not None:
            mask = (self.documents or document_mask)(doc_ids)
        if self.cfg.sliding_window and self.cfg.sliding_window < seq_len:
            # Validation refuses a document mask with it: the window is the only mask here.
            mask = window_mask(seq_len, self.cfg.sliding_window, h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask=mask)
        ahead: list[torch.Tensor] = []
        if mtp_tokens is not None and self.mtp is not None:
            assert self.tok_embeddings is not None, "a stage with MTP modules keeps the embedding"
            ahead = predict_ahead(self.mtp, self.tok_embeddings, h, mtp_tokens, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        if ahead:
            h = torch.cat([h, *ahead])
        if self.output is not None and not self.head_in_loss:
            h = self.output(h)
        return h


def build_on_meta(cfg: ModelConfig) -> Transformer:
    """Construct the model on the meta device: shapes only, no storage, no initialization."""
    with torch.device("meta"):
        return Transformer(cfg)
