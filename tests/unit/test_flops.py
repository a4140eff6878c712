"""models.flops agrees with what PyTorch counts on the real model, and with published sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from pretrain.core.model_config import ModelConfig
from pretrain.models.flops import count_params, flops_per_token
from pretrain.models.init import init_weights
from pretrain.models.llama import build_on_meta

SEQ_LEN, BATCH = 32, 2

# The tiny recipe's shape (recipes/model/tiny.yaml): 4 heads over 2 KV heads.
TINY = ModelConfig(
    vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512
)
VARIANTS = {
    "tiny_gqa": TINY,
    "multi_head": dataclasses.replace(TINY, n_kv_heads=0),
    "tied": dataclasses.replace(TINY, tie_embeddings=True),
    # One-input MLPs (GPT-3 and BLOOM's GeLU, Nemotron-4's squared ReLU): two matrices.
    "gelu": dataclasses.replace(TINY, mlp="gelu"),
    "relu2": dataclasses.replace(TINY, mlp="relu2"),
}


def counted_train_flops(cfg: ModelConfig, backend: SDPBackend | None) -> int:
    """FLOPs FlopCounterMode records for one forward + backward of a batch."""
    model = build_on_meta(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN))
    counter = FlopCounterMode(display=False)
    if backend is None:
        with counter:
            model(tokens).sum().backward()
    else:
        with sdpa_kernel(backend), counter:
            model(tokens).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_train_flops_equal_flop_counter_under_math_attention(cfg: ModelConfig) -> None:
    # The math backend runs attention as two batched matmuls, so their forward and
    # backward are counted like every other matmul: exactly the flops.py convention.
    expected = flops_per_token(cfg, SEQ_LEN).train * BATCH * SEQ_LEN
    assert counted_train_flops(cfg, SDPBackend.MATH) == expected


def test_fused_cpu_attention_is_invisible_to_flop_counter() -> None:
    # The CPU fused kernel has no registered FLOP formula: FlopCounterMode then sees only
    # the projections, MLP and head, so measuring MFU with it on CPU would undercount.
    per_token = flops_per_token(TINY, SEQ_LEN)
    expected = (per_token.train - 3 * per_token.attention_scores) * BATCH * SEQ_LEN
    assert counted_train_flops(TINY, backend=None) == expected


def test_fused_kernel_formulas_count_recomputed_scores_in_backward() -> None:
    # GPU flash/efficient kernels are counted by these formulas: the forward matches
    # flops.py, the backward counts 5 matmuls (it recomputes Q K^T) instead of our 4, so
    # FlopCounterMode on GPU reports attention scores at 3.5x forward where MFU uses 3x.
    cfg = TINY
    q = (BATCH, cfg.n_heads, SEQ_LEN, cfg.head_dim)
    kv = (BATCH, cfg.kv_heads, SEQ_LEN, cfg.head_dim)
    scores_per_layer = flops_per_token(cfg, SEQ_LEN).attention_scores // cfg.n_layers
    forward = scores_per_layer * BATCH * SEQ_LEN
    assert sdpa_flop_count(q, kv, kv) == forward
    assert sdpa_backward_flop_count(q, q, kv, kv) * 2 == 5 * forward


@pytest.mark.parametrize("mlp", ["swiglu", "gelu", "relu2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_param_count_equals_model_parameters(tied: bool, mlp: str) -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=tied, mlp=mlp)
    model = build_on_meta(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_tied_head_adds_no_parameters() -> None:
    untied = count_params(TINY)
    tied = count_params(dataclasses.replace(TINY, tie_embeddings=True))
    assert untied.total - tied.total == TINY.vocab_size * TINY.dim


@pytest.mark.parametrize(
    ("cfg", "published"),
    [
        (
            ModelConfig(
                vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336
            ),
            8.03e9,
        ),
        (
            ModelConfig(
                vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672
            ),
            70.6e9,
        ),
    ],
    ids=["llama3_8b", "llama3_70b"],
)
def test_param_count_matches_published_llama3_size(cfg: ModelConfig, published: float) -> None:
    assert count_params(cfg).total == pytest.approx(published, rel=0.01)


def test_one_input_mlps_compute_what_their_papers_define() -> None:
    """GeLU (Hendrycks and Gimpel 2016, tanh form as in GPT-2) and squared ReLU (So et al.
    2021, "Primer", section 4): w2 applied to the activation of w1 x, no gate."""
    from pretrain.models.layers import FeedForward

    x = torch.randn(3, 16)
    for kind, act in (
        (
            "gelu",
            lambda v: 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3))),
        ),
        ("relu2", lambda v: torch.clamp(v, min=0) ** 2),
    ):
        mlp = FeedForward(16, 24, kind)
        assert not hasattr(mlp, "w3")
        expected = act(x @ mlp.w1.weight.T) @ mlp.w2.weight.T
        torch.testing.assert_close(mlp(x), expected)
