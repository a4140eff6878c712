"""The Llama-style decoder and its layout-independent initialization."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from pretrain.core.model_config import ModelConfig
from pretrain.models import build
from pretrain.models.init import init_std, init_weights, initial_value
from pretrain.models.layers import Attention, RMSNorm
from pretrain.models.llama import Transformer, build_on_meta

# The tiny recipe's shape (recipes/model/tiny.yaml): 4 query heads share 2 KV heads.
TINY = ModelConfig(
    vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512
)
BATCH, SEQ_LEN = 2, 24


def initialized(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    model = build_on_meta(cfg)
    init_weights(model, seed)
    return model


def random_tokens(cfg: ModelConfig = TINY, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN), generator=g)


# --- forward -----------------------------------------------------------------------------


def test_forward_returns_float32_logits_per_position() -> None:
    logits = initialized()(random_tokens())
    assert logits.shape == (BATCH, SEQ_LEN, TINY.vocab_size)
    assert logits.dtype == torch.float32


def test_forward_under_autocast_returns_autocast_dtype() -> None:
    model = initialized()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(random_tokens())
    assert logits.dtype == torch.bfloat16


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    model = initialized()
    tokens = random_tokens()
    t = SEQ_LEN // 2
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    cfg = dataclasses.replace(TINY, max_seq_len=SEQ_LEN - 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        initialized(cfg)(random_tokens(cfg))


def test_rms_norm_normalizes_in_float32_and_returns_input_dtype() -> None:
    norm = RMSNorm(TINY.dim, eps=1e-5)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(TINY.dim, generator=g) + 0.5)
    # Small activations, so that eps visibly changes the result.
    x = 1e-2 * torch.randn(BATCH, SEQ_LEN, TINY.dim, generator=g)
    x64 = x.double()
    expected = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight.double()
    with torch.no_grad():
        torch.testing.assert_close(norm(x), expected.float())
        # bf16 activations and weight, as under mixed precision: the statistics are still
        # exact, and only the normalized value and the product are rounded to bf16.
        low, low_norm = x.bfloat16(), norm.bfloat16()
        out = low_norm(low)
    low64 = low.double()
    normed = (low64 / (low64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).bfloat16()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, normed * low_norm.weight)


# --- attention against an explicit reference ----------------------------------------------


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate [b, s, heads, d] as complex numbers: x[i] + j x[i + d/2] by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rotation
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def reference_attention(attn: Attention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Causal attention written out: every KV head repeated for the query heads it serves."""
    b, s, _ = x.shape
    q = reference_rope((x @ attn.wq.weight.T).view(b, s, cfg.n_heads, cfg.head_dim), cfg.rope_theta)
    k = reference_rope(
        (x @ attn.wk.weight.T).view(b, s, cfg.kv_heads, cfg.head_dim), cfg.rope_theta
    )
    v = (x @ attn.wv.weight.T).view(b, s, cfg.kv_heads, cfg.head_dim)
    group = cfg.n_heads // cfg.kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    future = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return out @ attn.wo.weight.T


def test_grouped_query_attention_equals_repeated_kv_reference() -> None:
    model = initialized()
    attn = model.layers["1"].attention
    x = torch.randn(BATCH, SEQ_LEN, TINY.dim, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rope_cos[:SEQ_LEN], model.rope_sin[:SEQ_LEN]
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, TINY))


def test_attention_reads_local_head_count_from_sharded_projections() -> None:
    # Column-shard wq/wk/wv by heads and row-shard wo, as tensor parallelism does: the
    # shards' outputs must sum to the full attention with no change to the module.
    model = initialized()
    full = model.layers["0"].attention
    x = torch.randn(BATCH, SEQ_LEN, TINY.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope_cos[:SEQ_LEN], model.rope_sin[:SEQ_LEN]
    tp = 2
    q_rows, kv_rows = full.wq.weight.shape[0] // tp, full.wk.weight.shape[0] // tp
    total = torch.zeros(BATCH, SEQ_LEN, TINY.dim)
    with torch.no_grad():
        for rank in range(tp):
            shard = Attention(TINY)
            q_part, kv_part = (
                slice(rank * q_rows, (rank + 1) * q_rows),
                slice(rank * kv_rows, (rank + 1) * kv_rows),
            )
            shard.wq.weight = nn.Parameter(full.wq.weight[q_part])
            shard.wk.weight = nn.Parameter(full.wk.weight[kv_part])
            shard.wv.weight = nn.Parameter(full.wv.weight[kv_part])
            shard.wo.weight = nn.Parameter(full.wo.weight[:, q_part])
            total += shard(x, cos, sin)
        torch.testing.assert_close(total, full(x, cos, sin))


# --- pipeline stages ----------------------------------------------------------------------


def test_stages_holding_subsets_of_layers_compose_to_the_full_model() -> None:
    full = initialized()
    first, last = initialized(), initialized()
    for name in ("2", "3"):
        del first.layers[name]
    for name in ("0", "1"):
        del last.layers[name]
    first.norm = first.output = None
    last.tok_embeddings = None
    tokens = random_tokens()
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (BATCH, SEQ_LEN, TINY.dim)
        torch.testing.assert_close(last(hidden), full(tokens))


def test_stage_keeps_parameter_names_of_the_layers_it_holds() -> None:
    model = build_on_meta(TINY)
    del model.layers["0"]
    names = {name for name, _ in model.named_parameters()}
    assert "layers.3.attention.wq.weight" in names
    assert not any(name.startswith("layers.0.") for name in names)


# --- meta build, materialization, tying -------------------------------------------------


def test_meta_build_allocates_no_storage() -> None:
    model = build(TINY)
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)


def test_materialized_model_matches_one_built_on_cpu_with_same_weights() -> None:
    # Rotary tables are non-persistent: init_buffers must recompute them after to_empty.
    from_meta = initialized()
    on_cpu = Transformer(TINY)
    on_cpu.load_state_dict(from_meta.state_dict())
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(from_meta(tokens), on_cpu(tokens))


def test_tied_head_shares_storage_with_embedding_after_init() -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    model = initialized(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    expected = initial_value(cfg, "tok_embeddings.weight", (cfg.vocab_size, cfg.dim), seed=0)
    assert torch.equal(model.output.weight, expected)


def test_tied_head_initial_value_is_the_embedding_on_a_head_only_stage() -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    shape = (cfg.vocab_size, cfg.dim)
    head = initial_value(cfg, "output.weight", shape, seed=5)
    assert torch.equal(head, initial_value(cfg, "tok_embeddings.weight", shape, seed=5))


# --- initialization -----------------------------------------------------------------------


def test_init_value_depends_only_on_name_and_seed_not_on_layers_built() -> None:
    full = dict(initialized().named_parameters())
    stage = build_on_meta(TINY)
    for name in ("0", "1"):
        del stage.layers[name]
    stage.tok_embeddings = None
    init_weights(stage, seed=0)
    stage_params = dict(stage.named_parameters())
    assert stage_params
    for name, param in stage_params.items():
        assert torch.equal(param, full[name]), name


def test_init_value_equals_initial_value_of_its_name() -> None:
    model = initialized(seed=7)
    param = model.layers["3"].attention.wq.weight
    expected = initial_value(TINY, "layers.3.attention.wq.weight", tuple(param.shape), seed=7)
    assert torch.equal(param, expected)


def test_init_is_repeatable_for_a_seed() -> None:
    first, second = initialized(seed=3).state_dict(), initialized(seed=3).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_different_seeds_give_different_random_weights() -> None:
    a, b = initialized(seed=0), initialized(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if init_std(TINY, name) is not None:
            assert not torch.equal(pa, pb), name


def test_different_parameters_get_independent_draws() -> None:
    layer = initialized().layers["0"].attention
    assert not torch.equal(layer.wk.weight, layer.wv.weight)


def test_norm_weights_are_ones() -> None:
    model = initialized()
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 2 * TINY.n_layers + 1
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_init_statistics_follow_the_std_rule() -> None:
    model = initialized()
    residual_std = TINY.init_std / math.sqrt(2 * TINY.n_layers)
    assert init_std(TINY, "layers.2.attention.wo.weight") == residual_std
    assert init_std(TINY, "layers.2.feed_forward.w2.weight") == residual_std
    assert init_std(TINY, "layers.2.feed_forward.w1.weight") == TINY.init_std
    assert init_std(TINY, "tok_embeddings.weight") == TINY.init_std
    for name, param in model.named_parameters():
        std = init_std(TINY, name)
        if std is None:
            continue
        n = param.numel()
        # 5 standard errors of the sample mean (std/sqrt(n)) and sample std (std/sqrt(2n)).
        assert abs(param.mean().item()) < 5 * std / math.sqrt(n), name
        assert abs(param.std().item() - std) < 5 * std / math.sqrt(2 * (n - 1)), name


def test_unknown_parameter_name_has_no_init_rule() -> None:
    with pytest.raises(ValueError, match="no initialization rule"):
        initial_value(TINY, "layers.0.attention.bias", (4,), seed=0)
