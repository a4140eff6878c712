"""model.rope_scaling: the frequencies of each scaling equal transformers' own rope init
functions, a Llama 3.1+-format checkpoint that transformers writes loads and gives its
logits, and a scaling the model cannot compute is refused by field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain import models
from pretrain.core.hf.llama import config_mismatches, model_fields
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate
from pretrain.models.rope import inverse_frequencies
from pretrain.trainer.checkpoint.hf_import import load_hf_weights

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
SCALINGS: dict[str, dict[str, Any]] = {
    "llama3": LLAMA3,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_deepseek": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_llama_config(scaling: dict[str, Any], **extra: Any) -> Any:
    """A small random-shaped LlamaConfig with `scaling` (transformers' own config class)."""
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500000.0, rope_scaling=dict(scaling), tie_word_embeddings=True, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_equal_transformers_rope_init_functions(name: str) -> None:
    scaling = SCALINGS[name]
    config = hf_llama_config(scaling)
    expected, expected_factor = rope_utils.ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    actual, factor = inverse_frequencies(16, 500000.0, scaling)
    plain, _ = inverse_frequencies(16, 500000.0)
    if name != "dynamic":  # dynamic changes nothing within max_position_embeddings
        assert not torch.allclose(actual, plain)
    torch.testing.assert_close(actual.float(), expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_a_scaled_llama_checkpoint_from_transformers_gives_its_logits(
    name: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_llama_config(SCALINGS[name])).eval()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(**model_fields(hf.config.to_dict()))
    assert cfg.rope_scaling == SCALINGS[name] and not config_mismatches(hf.config.to_dict(), cfg)
    ours = models.build(cfg).to_empty(device="cpu")
    ours.init_buffers("cpu")
    assert load_hf_weights(ours, cfg, tmp_path) == len(list(ours.parameters()))
    tokens = torch.randint(0, 300, (2, 48))  # past original_max_position_embeddings
    with torch.no_grad():
        expected, actual = hf(tokens).logits, ours(tokens)
    print(f"{name}: max |logits difference| {(actual - expected).abs().max():.2e}")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_with_another_scaling_is_a_mismatch_naming_both() -> None:
    hf = hf_llama_config(LLAMA3).to_dict()
    cfg = ModelConfig(**{**model_fields(hf), "rope_scaling": {}})
    (found,) = [p for p in config_mismatches(hf, cfg) if "rope scaling" in p]
    assert "'rope_type': 'llama3'" in found and "model.rope_scaling=none here" in found


@pytest.mark.parametrize(
    ("scaling", "field", "reason"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, "model.rope_scaling.rope_type", "is not a"),
        ({"rope_type": "llama3", "factor": 8.0}, "model.rope_scaling.low_freq_factor", "needs"),
        ({"rope_type": "linear", "factor": 2.0, "beta": 1}, "model.rope_scaling.beta", "not read"),
        ({"rope_type": "linear", "factor": -2.0}, "model.rope_scaling.factor", "positive"),
        (
            {**LLAMA3, "high_freq_factor": 0.5},
            "model.rope_scaling.high_freq_factor",
            "must exceed low_freq_factor",
        ),
    ],
)
def test_a_scaling_the_model_cannot_compute_is_refused_by_field(
    scaling: dict[str, Any], field: str, reason: str
) -> None:
    cfg = RecipeConfig()
    cfg.model.rope_scaling = scaling
    with pytest.raises(RecipeError) as err:
        validate(cfg)
    (problem,) = [p for p in err.value.problems if p.field == field]
    assert reason in problem.reason


def test_import_then_export_of_a_scaled_llama_is_bit_exact_and_reloads(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from pretrain.core.hf.llama import config_json
    from pretrain.trainer.checkpoint.hf_tensors import to_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_llama_config(SCALINGS["llama3"])).eval()
    hf.save_pretrained(tmp_path / "in")
    cfg = ModelConfig(**model_fields(hf.config.to_dict()))
    ours = models.build(cfg).to_empty(device="cpu")
    ours.init_buffers("cpu")
    load_hf_weights(ours, cfg, tmp_path / "in")
    written = {}
    for name, tensor in ours.state_dict().items():
        if name != "output.weight":  # tied: transformers ties lm_head itself
            written.update(to_hf(name, tensor, cfg))
    original = load_file(tmp_path / "in" / "model.safetensors")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)

    out = tmp_path / "out"
    out.mkdir()
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(cfg, None)))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_the_latent_attentions_softmax_factor_equals_transformers(name: str) -> None:
    """DeepSeek's attention multiplies its softmax scale by mscale_all_dim's factor squared."""
    from pretrain.models.rope import softmax_mscale

    scaling = SCALINGS[name]
    assert softmax_mscale(scaling) == pytest.approx(
        rope_utils.yarn_apply_mscale(scaling, 1.0), rel=1e-12
    )
