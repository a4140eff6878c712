"""Each family transformers writes (Llama 3.2 with RoPE scaling, Qwen2 with q/k/v biases,
Qwen3 with query/key norms and a head width apart from dim / n_heads, Mistral with a sliding
window shorter than the tokens, Mixtral, Qwen2-MoE with gated shared experts and a dense
layer, Qwen3-MoE every second layer, DeepSeek-V2 with YaRN's mscale and DeepSeek-V3 with
group-limited sigmoid routing and its balancing bias) imports with its logits, and exports
bit-exact with no step taken to a folder transformers reloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain import models
from pretrain.core.hf.llama import config_mismatches, model_fields
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.trainer.checkpoint.export import hf_config
from pretrain.trainer.checkpoint.hf_import import load_hf_weights
from pretrain.trainer.checkpoint.hf_tensors import to_hf

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
EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
QWEN2_MOE = {
    **EXPERTS, "num_experts": 4, "shared_expert_intermediate_size": 64, "mlp_only_layers": [0],
}  # fmt: skip
"""Two shared experts' width behind the gate, a dense first layer, top-2 not renormalized."""
QWEN3_MOE = {**EXPERTS, "num_experts": 4, "decoder_sparse_step": 2, "norm_topk_prob": True}
"""Every second layer MoE (model.moe_layers=every:2), top-2 renormalized."""
MLA = {
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 4,
}  # fmt: skip
DEEPSEEK_V2 = {
    **EXPERTS, **MLA, "q_lora_rank": None, "n_shared_experts": 2,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
    },
}  # fmt: skip
"""DeepSeek-V2-Lite's shape: queries straight from the hidden state, a dense first layer,
2 shared experts, softmax top-2 not renormalized, YaRN whose mscale_all_dim scales the
softmax."""
DEEPSEEK_V3 = {
    **EXPERTS, **MLA, "q_lora_rank": 24, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True,
}  # fmt: skip
"""DeepSeek-V3's: a query latent, sigmoid routing within 1 of 2 expert groups biased by
e_score_correction_bias, renormalized top-2 scaled by 2.5."""
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3.2": (
        "Llama",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "mistral": ("Mistral", {"sliding_window": 8}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2Moe", QWEN2_MOE),
    "qwen3_moe": ("Qwen3Moe", QWEN3_MOE),
    "deepseek_v2": ("DeepseekV2", DEEPSEEK_V2),
    "deepseek_v3": ("DeepseekV3", DEEPSEEK_V3),
}
"""Family -> (transformers' class prefix, config beyond SHAPE)."""


def hf_model(name: str) -> Any:
    prefix, extra = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them count
        for param_name, param in model.named_parameters():
            if param_name.endswith(("bias", "norm.weight")):
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.1)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def imported(folder: Path) -> tuple[torch.nn.Module, ModelConfig]:
    hf = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig(**model_fields(hf))
    assert not config_mismatches(hf, cfg)
    ours = models.build(cfg).to_empty(device="cpu")
    ours.init_buffers("cpu")
    biases = [b for n, b in ours.named_buffers() if n.endswith("expert_bias")]
    assert load_hf_weights(ours, cfg, folder) == len(list(ours.parameters())) + len(biases)
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
            written.update(to_hf(param_name, tensor, cfg))
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


@pytest.mark.parametrize(
    ("recipe", "architecture"),
    [("tiny_moe", "Qwen2MoeForCausalLM"), ("deepseek_v2_lite", "DeepseekV2ForCausalLM")],
)
def test_the_shipped_moe_recipes_export_to_a_config_transformers_builds_with_our_parameters(
    recipe: str, architecture: str
) -> None:
    """tiny_moe (GQA, a shared expert without a gate, a dense first layer) is a Qwen2-MoE and
    deepseek_v2_lite a DeepSeek-V2: nothing refused, and transformers' model of the exported
    config.json has as many parameters as ours (tiny_moe's plus Qwen2-MoE's zero gates)."""
    from pretrain.core.hf.export import export_refusal
    from pretrain.models.flops import count_params
    from tests.helpers import compose_recipe

    cfg = compose_recipe(recipe, [])
    assert export_refusal(cfg.model, 1) is None
    config = hf_config(cfg, None)
    assert config["architectures"] == [architecture]
    hf_class = getattr(transformers, architecture)
    with torch.device("meta"):
        hf = hf_class(hf_class.config_class.from_dict(config))
    ungated = architecture == "Qwen2MoeForCausalLM" and not cfg.model.moe_shared_gate
    gates = cfg.model.n_moe_layers * cfg.model.dim if ungated else 0
    assert sum(p.numel() for p in hf.parameters()) == count_params(cfg.model).total + gates
