"""init.from_hf in one process: what transformers saves loads into our model with the same
logits, and a checkpoint of another shape is refused naming the tensor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.models.init import init_weights
from pretrain.trainer.checkpoint.hf_import import load_hf_weights

transformers = pytest.importorskip("transformers")

MODEL = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=64, rope_theta=10000.0)  # fmt: skip


def plain(cfg: ModelConfig) -> torch.nn.Module:
    model = models.build(cfg).to_empty(device="cpu")
    model.init_buffers("cpu")
    init_weights(model, seed=0)
    return model


def saved_by_transformers(folder: Path, cfg: ModelConfig) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return hf


def test_a_transformers_checkpoint_gives_the_same_logits_in_our_model(tmp_path: Path) -> None:
    hf = saved_by_transformers(tmp_path, MODEL)
    ours = plain(MODEL)
    assert load_hf_weights(ours, MODEL, tmp_path) == len(list(ours.parameters()))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    saved_by_transformers(tmp_path, MODEL)
    wider = dataclasses.replace(MODEL, ffn_dim=96)
    with pytest.raises(ValueError, match=r"intermediate_size=64 there, model\.ffn_dim=96 here"):
        load_hf_weights(plain(wider), wider, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight is \[64, 32\] there"):
        load_hf_weights(plain(wider), wider, tmp_path)


def test_a_one_input_mlp_is_refused_against_a_llama_checkpoint() -> None:
    """LlamaForCausalLM's MLP is SwiGLU (gate, up, down): a GeLU model cannot load it."""
    from pretrain.core.hf.llama import config_json, config_mismatches

    llama = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64)
    gelu = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, mlp="gelu")
    assert config_mismatches(config_json(llama, None), llama) == []
    [found] = config_mismatches(config_json(llama, None), gelu)
    assert "model.mlp=gelu" in found
