"""The attention options of public families are recipe fields with validation: an odd
head width, Qwen's options under multi-head latent attention and a sliding window with a
document mask or context parallelism are refused by field; the FLOPs count a window's keys."""

from __future__ import annotations

import pytest

from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate
from pretrain.models.flops import flops_per_token


def problems_of(**model: object) -> dict[str, str]:
    cfg = RecipeConfig()
    for name, value in model.items():
        if name.startswith("data_"):
            setattr(cfg.data, name[5:], value)
        elif name.startswith("parallel_"):
            setattr(cfg.parallel, name[9:], value)
        else:
            setattr(cfg.model, name, value)
    try:
        validate(cfg)
    except RecipeError as err:
        return {p.field: p.reason for p in err.problems}
    return {}


def test_head_dim_reads_back_as_the_width_and_may_differ_from_dim_over_heads() -> None:
    assert ModelConfig(dim=128, n_heads=4).head_dim == 32
    assert ModelConfig(dim=128, n_heads=4, head_dim=48).head_dim == 48
    assert problems_of(head_dim=48) == {}
    assert "odd head width" in problems_of(head_dim=47)["model.head_dim"]


@pytest.mark.parametrize("option", ["qk_norm", "attn_bias"])
def test_qwen_options_under_latent_attention_are_refused(option: str) -> None:
    found = problems_of(attention="mla", **{option: True})
    assert "grouped-query attention option" in found[f"model.{option}"]


def test_a_sliding_window_with_a_document_mask_or_context_parallelism_is_refused() -> None:
    assert "not combined" in problems_of(sliding_window=64, data_doc_mask=True)["data.doc_mask"]
    found = problems_of(sliding_window=64, parallel_cp=2)
    assert "sliding_window=64" in found["parallel.cp"]


def test_a_sliding_window_counts_only_its_keys_in_the_attention_flops() -> None:
    full = flops_per_token(ModelConfig(), seq_len=2048)
    windowed = flops_per_token(ModelConfig(sliding_window=512), seq_len=2048)
    assert windowed.attention_scores * 4 == full.attention_scores
    assert windowed.attention_projections == full.attention_projections
