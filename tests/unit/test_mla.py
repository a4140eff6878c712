"""Multi-head latent attention: DeepSeek-V2's shapes and parameter count, FLOPs, causality."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.models.flops import count_params, flops_per_token
from pretrain.models.init import init_weights
from pretrain.models.mla import MultiHeadLatentAttention
from pretrain.trainer.checkpoint.export import refuse_unexportable
from tests.helpers import REPO

SMALL = dict(vocab_size=64, dim=64, n_heads=4, ffn_dim=96, n_layers=2, attention="mla")


def deepseek_v2_lite() -> ModelConfig:
    node = OmegaConf.load(REPO / "recipes" / "model" / "deepseek_v2_lite.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def test_deepseek_v2_lite_has_the_published_checkpoints_parameter_count() -> None:
    cfg = deepseek_v2_lite()
    assert cfg.is_mla and (cfg.kv_rank, cfg.rope_dim, cfg.nope_dim, cfg.v_head_dim) == (
        512,
        64,
        128,
        128,
    )
    assert count_params(cfg).total == 15_706_484_224
    assert sum(p.numel() for p in models.build(cfg).parameters()) == 15_706_484_224


@pytest.mark.parametrize("q_rank", [0, 24])
def test_parameter_count_is_the_modules(q_rank) -> None:
    cfg = ModelConfig(**SMALL, mla_q_rank=q_rank)
    assert count_params(cfg).total == sum(p.numel() for p in models.build(cfg).parameters())


def test_flops_count_the_latent_projections_and_the_wider_query_key_heads() -> None:
    cfg = ModelConfig(**SMALL, mla_kv_rank=32, mla_rope_dim=8, mla_nope_dim=16, mla_v_dim=12)
    h, heads, s = 64, 4, 128
    projections = 2 * (h * heads * 24 + h * (32 + 8) + 32 * heads * (16 + 12) + heads * 12 * h)
    fpt = flops_per_token(cfg, s)
    assert fpt.attention_projections == 2 * projections
    assert fpt.attention_scores == 2 * 2 * s * heads * (24 + 12)


def test_a_later_token_changes_no_earlier_output() -> None:
    cfg = ModelConfig(**SMALL, mla_q_rank=24)
    model = models.build(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_packed_documents_do_not_see_each_other() -> None:
    cfg = ModelConfig(**SMALL, mla_q_rank=24)
    model = models.build(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7] * 2)
    changed = tokens.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 64  # inside the first document
    with torch.no_grad():
        before, after = model(tokens, doc_ids=doc_ids), model(changed, doc_ids=doc_ids)
    assert torch.equal(before[:, 5:], after[:, 5:])
    assert not torch.allclose(before[:, 2:5], after[:, 2:5])


def test_keys_share_one_rotary_part_across_heads() -> None:
    cfg = ModelConfig(**SMALL)
    attention = MultiHeadLatentAttention(cfg)
    seen = []
    attention.shared_key.register_forward_hook(lambda m, i, out: seen.append(out))
    cos, sin = torch.ones(5, cfg.rope_dim // 2), torch.zeros(5, cfg.rope_dim // 2)
    torch.nn.init.normal_(attention.wkv_a.weight)
    attention(torch.randn(2, 5, 64), cos, sin)
    assert seen[0].shape == (2, 5, 1, cfg.rope_dim)


def test_export_refuses_an_mla_model_whose_latent_norms_deepseek_cannot_hold() -> None:
    cfg = RecipeConfig()
    cfg.model = ModelConfig(**SMALL, norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"DeepseekV2ForCausalLM:\nmodel\.norm_eps=1e-05: Dee"):
        refuse_unexportable(cfg)
    cfg.model.norm_eps = 1e-6
    refuse_unexportable(cfg)
