"""The fused-projection benchmark compares what it says it compares: its fused variants
compute the model's function, and its tp-exact layout is the one a contiguous Shard(0) over
tp splits into exactly each rank's q, k, v heads and gate, up rows, as Megatron shards them."""

from __future__ import annotations

import pytest
import torch

from bench.fused_projections import VARIANTS, build_variant
from pretrain.core.model_config import ModelConfig


def config(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        name="llama", vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=kv_heads,
        ffn_dim=96, max_seq_len=16,
    )  # fmt: skip


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_every_variant_gives_the_separate_models_logits(kv_heads: int) -> None:
    cfg = config(kv_heads)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {v: build_variant(cfg, v, seed=7)(tokens) for v in VARIANTS}
    for variant in VARIANTS[1:]:
        torch.testing.assert_close(logits[variant], logits["separate"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_contiguous_shard_of_the_tp_exact_rows_is_each_ranks_heads_and_ffn_rows(
    tp: int,
) -> None:
    cfg = config(kv_heads=4)
    separate = build_variant(cfg, "separate", seed=7).layers["0"]
    fused = build_variant(cfg, "tp-exact", seed=7).layers["0"]
    attention, ffn = separate.attention, separate.feed_forward
    d, q_per_group = cfg.head_dim, cfg.n_heads // cfg.kv_heads
    groups = cfg.kv_heads // tp
    f = cfg.ffn_dim // tp
    for rank in range(tp):
        heads = range(rank * groups, (rank + 1) * groups)
        megatron_qkv = torch.cat(
            [
                rows
                for g in heads
                for rows in (
                    attention.wq.weight[g * q_per_group * d : (g + 1) * q_per_group * d],
                    attention.wk.weight[g * d : (g + 1) * d],
                    attention.wv.weight[g * d : (g + 1) * d],
                )
            ]
        )
        assert torch.equal(fused.attention.wqkv.weight.chunk(tp)[rank], megatron_qkv)
        gate, up = (w.weight[rank * f : (rank + 1) * f] for w in (ffn.w1, ffn.w3))
        w13 = fused.feed_forward.w13.weight.chunk(tp)[rank]
        assert torch.equal(w13[0::2], gate) and torch.equal(w13[1::2], up)
