"""Deterministic initialization that does not depend on the parallel layout.

Every parameter's initial value is a function of (seed, its name in the plain model, its
full shape) alone: each draws from its own generator seeded by a stable hash of the seed
and the name. So a pipeline stage that holds layers 2-3, a tensor-parallel shard that
slices its part out of the full tensor, and a single-device model all start from the
same weights, whatever else exists and in whatever order it is initialized.
"""

from __future__ import annotations

import hashlib
import math

import torch

from pretrain.core.model_config import ModelConfig
from pretrain.models.llama import Transformer

_NORM_SUFFIXES = (
    "attention_norm.weight",
    "ffn_norm.weight",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
    "attention.kv_norm.weight",
    ".enorm.weight",  # a multi-token prediction module's norms (models/mtp.py)
    ".hnorm.weight",
    ".norm.weight",
)
_BIAS_SUFFIXES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")
"""Biases start at zero (model.attn_bias)."""
# Stacked expert weights are drawn whole ([N, ...]) and sliced by expert parallelism.
_RESIDUAL_OUT_SUFFIXES = (
    "attention.wo.weight",
    "feed_forward.w2.weight",
    "feed_forward.experts.w2",
    "feed_forward.shared.w2.weight",
)
_LINEAR_SUFFIXES = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wq_a.weight",
    "attention.wq_b.weight",
    "attention.wkv_a.weight",
    "attention.wkv_b.weight",
    "feed_forward.w1.weight",
    "feed_forward.w3.weight",
    "feed_forward.router.weight",
    "feed_forward.experts.w1",
    "feed_forward.experts.w3",
    "feed_forward.shared.w1.weight",
    "feed_forward.shared.w3.weight",
    "feed_forward.shared_gate.weight",
    "eh_proj.weight",
)


def _generator(seed: int, name: str) -> torch.Generator:
    # Python's hash() is salted per process; sha256 gives every rank the same stream.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def init_std(cfg: ModelConfig, name: str) -> float | None:
    """The normal std for parameter `name`, or None for a norm weight (initialized to ones).

    Projections that write into the residual stream (wo, w2) are scaled by 1/sqrt(2L) so
    the residual's variance does not grow with depth.
    """
    if name == "norm.weight" or name.endswith(_NORM_SUFFIXES):
        return None
    if name in ("tok_embeddings.weight", "output.weight") or name.endswith(_LINEAR_SUFFIXES):
        return cfg.init_std
    if name.endswith(_RESIDUAL_OUT_SUFFIXES):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    raise ValueError(f"no initialization rule for parameter {name!r}")


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (unsharded) float32 initial tensor of parameter `name` for `seed`."""
    if cfg.tie_embeddings and name == "output.weight":
        # A tied head is the embedding, also on a pipeline stage that holds only the head.
        name = "tok_embeddings.weight"
    if name.endswith(_BIAS_SUFFIXES):
        return torch.zeros(shape)
    std = init_std(cfg, name)
    if std is None:
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Materialize a plain (non-sharded) model on CPU if it is on meta, then initialize it."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    # named_parameters() yields a shared (tied) weight once, under the embedding's name.
    for name, param in model.named_parameters():
        param.copy_(initial_value(model.cfg, name, tuple(param.shape), seed))
    model.init_buffers()
