"""Each dense family transformers writes (Llama 3.2 with RoPE scaling, Qwen2 with q/k/v
biases, Qwen3 with query/key norms and a head width apart from dim / n_heads, Mistral with
a sliding window shorter than the tokens, Mixtral) imports with its logits, and exports bit-exact
with no step taken to a folder transformers reloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain import models
from pretrain.core.hf_llama import config_mismatches, model_fields
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.trainer.checkpoint.export import hf_config, hf_tensors
from pretrain.trainer.checkpoint.hf_import import load_hf_weights

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPE = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}  # fmt: skip
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3.2": (
        "Llama",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "mistral": ("Mistral", {"sliding_window": 8}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
"""Family -> (transformers' class prefix, config beyond SHAPE)."""


def hf_model(name: str) -> Any:
    prefix, extra = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them count
        for param_name, param in model.named_parameters():
            if param_name.endswith(("bias", "norm.weight")):
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.1)
    return model


def imported(folder: Path) -> tuple[torch.nn.Module, ModelConfig]:
    hf = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig(**model_fields(hf))
    assert not config_mismatches(hf, cfg)
    ours = models.build(cfg).to_empty(device="cpu")
    ours.init_buffers("cpu")
    assert load_hf_weights(ours, cfg, folder) == len(list(ours.parameters()))
    return ours.eval(), cfg


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_imports_with_its_logits_and_round_trips_bit_exact(
    name: str, tmp_path: Path
) -> None:
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "in")
    ours, cfg = imported(tmp_path / "in")
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        expected, actual = hf(tokens).logits, ours(tokens)
    print(f"{name}: import max |logits difference| {(actual - expected).abs().max():.2e}")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)

    written = {}
    for param_name, tensor in ours.state_dict().items():
        if not (param_name == "output.weight" and cfg.tie_embeddings):
            written.update(hf_tensors(param_name, tensor))
    original = safetensors_torch.load_file(tmp_path / "in" / "model.safetensors")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)

    out = tmp_path / "out"
    out.mkdir()
    safetensors_torch.save_file(written, str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(RecipeConfig(model=cfg), None)))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=0)


def test_a_family_the_trainer_cannot_build_is_refused_by_name() -> None:
    config = transformers.GemmaConfig(**SHAPE).to_dict()
    problems = config_mismatches(config, ModelConfig(**model_fields(config)))
    assert any("model_type 'gemma' is a family this trainer does not build" in p for p in problems)
