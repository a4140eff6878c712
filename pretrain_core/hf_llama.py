"""The Hugging Face Llama layout of our dense model: tensor names, shapes, config.json.

One name mapping serves export (`pretrain-export`) and import (`init.from_hf`). A directory
is checked against a recipe before any job starts by reading config.json and the
safetensors headers (an 8-byte length, then JSON), so no tensor is loaded and no torch is
needed. Our rotary embedding is the half-split layout Hugging Face's Llama uses: the
attention weights are copied unpermuted both ways.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pretrain_core.model_config import ModelConfig

BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
"""Our parameter names after "layers.{i}." -> Hugging Face Llama's after "model.layers.{i}."."""
MOE_NAMES = {"feed_forward.router.weight": "block_sparse_moe.gate.weight"}
"""The same for a MoE layer's router, in Mixtral's layout (its stacked experts are split
into one tensor per expert by the exporter)."""
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def hf_name(name: str) -> str:
    """The Hugging Face Llama (or Mixtral) name of one of our parameters that is not a
    stacked expert weight."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{BLOCK_NAMES.get(rest) or MOE_NAMES[rest]}"


def expected_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our dense model's parameter names and shapes (the LM head left out when tied)."""
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    block: dict[str, tuple[int, ...]] = {
        "attention_norm.weight": (m.dim,),
        "attention.wq.weight": (q, m.dim),
        "attention.wk.weight": (kv, m.dim),
        "attention.wv.weight": (kv, m.dim),
        "attention.wo.weight": (m.dim, q),
        "ffn_norm.weight": (m.dim,),
        "feed_forward.w1.weight": (m.ffn_dim, m.dim),
        "feed_forward.w3.weight": (m.ffn_dim, m.dim),
        "feed_forward.w2.weight": (m.dim, m.ffn_dim),
    }
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (m.vocab_size, m.dim)}
    for i in range(m.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes["norm.weight"] = (m.dim,)
    if not m.tie_embeddings:
        shapes["output.weight"] = (m.vocab_size, m.dim)
    return shapes


CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "intermediate_size": "ffn_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_embeddings",
}
"""config.json key -> our model field that must hold the same value (transformers 5 keeps
rope_theta under rope_parameters)."""


def config_json(m: ModelConfig, eos: int | None) -> dict[str, Any]:
    """config.json of the equivalent LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def config_mismatches(hf: dict[str, Any], m: ModelConfig) -> list[str]:
    """How config.json differs from the recipe's model, one phrase each."""
    found = []
    rope = hf.get("rope_parameters") or {}
    hf = {"rope_theta": rope.get("rope_theta"), **hf}
    if hf.get("model_type") != "llama":
        found.append(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    for key, ours in CONFIG_FIELDS.items():
        theirs = hf.get(key, False if key == "tie_word_embeddings" else None)
        if theirs != getattr(m, ours) and not (
            isinstance(theirs, float) and abs(theirs - getattr(m, ours)) <= 1e-12 * abs(theirs)
        ):
            found.append(f"{key}={theirs!r} there, model.{ours}={getattr(m, ours)!r} here")
    kv = hf.get("num_key_value_heads", hf.get("num_attention_heads"))
    if kv != m.kv_heads:
        found.append(f"num_key_value_heads={kv!r} there, {m.kv_heads} key/value heads here")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            found.append(f"{key}=true there; this model has no biases")
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        scaling = hf.get("rope_scaling") or rope
        found.append(f"rope scaling {scaling!r} there; this model has plain RoPE")
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act={hf['hidden_act']!r} there; this model uses silu (SwiGLU)")
    if m.mlp != "swiglu":
        found.append(f"model.mlp={m.mlp} here; LlamaForCausalLM's MLP is SwiGLU (model.mlp=swiglu)")
    return found


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face directory (sharded ones through the index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / name for name in weight_map.values()})
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    return sorted(folder.glob("*.safetensors"))


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{path}: a {length}-byte header; not a safetensors file")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header  # type: ignore[no-any-return]


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(folder):
        for name, info in safetensors_header(path).items():
            shapes[name] = tuple(info["shape"])
    return shapes


def checkpoint_problems(folder: Path, m: ModelConfig) -> list[str]:
    """Why a Hugging Face directory cannot initialize the recipe's model (empty: it can)."""
    if m.moe_experts:
        return ["only dense Llama checkpoints load; this model has mixture-of-experts layers"]
    config = folder / "config.json"
    if not config.is_file():
        return [f"no config.json in {folder}"]
    problems = config_mismatches(json.loads(config.read_text()), m)
    if not safetensors_files(folder):
        return [*problems, f"no *.safetensors files in {folder}"]
    try:
        shapes = tensor_shapes(folder)
    except (ValueError, KeyError, OSError) as exc:
        return [*problems, str(exc)]
    for ours, shape in expected_shapes(m).items():
        name = hf_name(ours)
        if name not in shapes:
            problems.append(f"{name} is missing (needed for {ours} {list(shape)})")
        elif shapes[name] != shape:
            problems.append(f"{name} is {list(shapes[name])} there, {ours} is {list(shape)} here")
    return problems
