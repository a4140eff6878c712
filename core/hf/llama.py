"""The Hugging Face layout of our model: tensor names, shapes, config.json.

The dense families share Llama's names: Llama (3.0-3.3), Qwen2 (`model.attn_bias`: q/k/v
biases), Qwen3 (`model.qk_norm`: per-head query and key norms; `model.head_dim` apart from
dim / n_heads) and Mistral (`model.sliding_window`). The mixture-of-experts and latent
attention families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) add their own names and
config keys (core/hf/moe.py). Any other `model_type` is refused by name.

One name mapping serves export (`pretrain-export`) and import (`init.from_hf`). A directory
is checked against a recipe before any job starts by reading config.json and the
safetensors headers (an 8-byte length, then JSON), so no tensor is loaded and no torch is
needed. Our rotary embedding is the half-split layout Hugging Face's Llama uses: the
attention weights are copied unpermuted both ways (DeepSeek's interleaved rotary rows are
permuted, trainer/checkpoint/hf_tensors.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pretrain.core.hf.moe import (
    DEEPSEEK,
    MOE_FAMILIES,
    block_names,
    mla_shapes,
    moe_config,
    moe_family,
    moe_fields,
    moe_shapes,
    refusals,
)
from pretrain.core.inputs.reading import ReadError, mapping, read_mapping, read_span
from pretrain.core.model_config import ModelConfig

BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
"""Our parameter names after "layers.{i}." -> Hugging Face Llama's after "model.layers.{i}."."""
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DENSE_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
FAMILIES = DENSE_FAMILIES | MOE_FAMILIES
"""config.json model_type -> architecture of every family that loads and exports."""
WINDOWED = ("mistral", "mixtral")
"""Families with one sliding window on every layer (config.json's sliding_window)."""
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def hf_names(name: str, m: ModelConfig) -> list[str]:
    """The Hugging Face tensors one of our parameters (or balancing biases) is made of in
    this model's family: one per expert for a stacked expert weight."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        found = block_names(rest, index, m)
        if found is not None:
            return [f"model.layers.{index}.{each}" for each in found]
    return [hf_name(name)]


def hf_name(name: str) -> str:
    """The Hugging Face name of one of our parameters the dense families share."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{BLOCK_NAMES[rest]}"


def expected_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameter (and balancing bias) names and shapes (the LM head left out
    when tied)."""
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    attention: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (q, m.dim),
        "attention.wk.weight": (kv, m.dim),
        "attention.wv.weight": (kv, m.dim),
        "attention.wo.weight": (m.dim, q),
    }
    if m.attn_bias:
        attention |= {
            "attention.wq.bias": (q,),
            "attention.wk.bias": (kv,),
            "attention.wv.bias": (kv,),
        }
    if m.qk_norm:
        attention |= {
            "attention.q_norm.weight": (m.head_dim,),
            "attention.k_norm.weight": (m.head_dim,),
        }
    norms = {"attention_norm.weight": (m.dim,), "ffn_norm.weight": (m.dim,)}
    moe = norms | (mla_shapes(m) if m.is_mla else attention)
    block = moe | {
        "feed_forward.w1.weight": (m.ffn_dim, m.dim),
        "feed_forward.w3.weight": (m.ffn_dim, m.dim),
        "feed_forward.w2.weight": (m.dim, m.ffn_dim),
    }
    if m.moe_experts:
        moe |= moe_shapes(m)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (m.vocab_size, m.dim)}
    for i in range(m.n_layers):
        layer = moe if m.is_moe_layer(i) else block
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
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
SCALING_KEYS_DROPPED = ("rope_theta", "type")
"""Keys of a config.json's rope_parameters that are not part of model.rope_scaling: the base
has its own field, `type` is the old spelling of `rope_type`."""


def hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's RoPE scaling as model.rope_scaling holds it: empty for plain RoPE. Reads
    transformers 5's `rope_parameters` and the older `rope_scaling` (`type` or `rope_type`)."""
    found = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = found.get("rope_type", found.get("type", "default"))
    if kind == "default":
        return {}
    return {"rope_type": kind} | {
        k: v for k, v in found.items() if k not in SCALING_KEYS_DROPPED and k != "rope_type"
    }


def same_value(theirs: Any, ours: Any) -> bool:
    """Equal, floats (and ints written as floats) up to 1e-12 relative."""
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)):
        if isinstance(theirs, bool) or isinstance(ours, bool):
            return theirs is ours
        return abs(theirs - ours) <= 1e-12 * max(abs(theirs), abs(ours))
    return bool(theirs == ours)


def same_scaling(theirs: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether two model.rope_scaling mappings say the same."""
    return theirs.keys() == ours.keys() and all(same_value(theirs[k], ours[k]) for k in theirs)


def config_json(m: ModelConfig, eos: int | None, groups: int = 1) -> dict[str, Any]:
    """config.json of the equivalent model of this model's family (`groups`: the expert
    groups its router limits each token to, 1 without a limit)."""
    kind = family(m)
    extra: dict[str, Any] = {"use_sliding_window": False} if kind.startswith("qwen") else {}
    if kind == "mistral":
        extra["sliding_window"] = m.sliding_window
    config = {
        "architectures": [FAMILIES[kind]],
        "model_type": kind,
        **extra,
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
        # The pre-5 spelling: transformers 4 and 5 both read it (5 as rope_parameters).
        "rope_scaling": dict(m.rope_scaling) or None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    } | moe_config(m, groups)
    if kind in DEEPSEEK:
        del config["head_dim"]  # DeepSeek's is its rotary width, which it sets itself
    return config


def family(m: ModelConfig) -> str:
    """The Hugging Face model_type of our model's options."""
    kind = moe_family(m)
    if kind is not None:
        return kind
    if m.qk_norm:
        return "qwen3"
    if m.attn_bias:
        return "qwen2"
    return "mistral" if m.sliding_window else "llama"


def same_family(kind: Any, m: ModelConfig) -> bool:
    """Whether config.json's model_type may hold our model: its family, Mistral without a
    window for Llama, or any MoE family for a MoE model (their fields then decide)."""
    ours = family(m)
    return (
        kind == ours
        or (kind, ours) == ("mistral", "llama")
        or (kind in MOE_FAMILIES and ours in MOE_FAMILIES)
    )


def hf_head_dim(hf: dict[str, Any]) -> int | None:
    """The head width config.json states or implies."""
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The model.* fields a Llama config.json states, by our names (what `init.from_hf`
    adopts): the shape, norm epsilon, RoPE base and scaling, tied embeddings. Not the
    length: max_position_embeddings is what the checkpoint can take, model.max_seq_len what
    this run trains on."""
    rope = hf.get("rope_parameters") or {}
    hf = {"rope_theta": rope.get("rope_theta", 10000.0), "tie_word_embeddings": False, **hf}
    fields = {ours: hf[key] for key, ours in CONFIG_FIELDS.items() if key in hf}
    if "num_attention_heads" in hf:
        fields["n_kv_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    fields["rope_scaling"] = hf_rope_scaling(hf)
    if hf_head_dim(hf) is not None:
        fields["head_dim"] = hf_head_dim(hf)
    kind = hf.get("model_type")
    fields["attention"] = "gqa"
    fields["qk_norm"] = kind == "qwen3"
    fields["attn_bias"] = kind == "qwen2"
    fields["sliding_window"] = (hf.get("sliding_window") or 0) if kind in WINDOWED else 0
    fields["moe_experts"] = 0
    fields |= moe_fields(hf)
    if kind in DEEPSEEK:
        fields.pop("head_dim", None)  # DeepSeek's head_dim is its rotary width: mla_rope_dim
    return fields


def _ours(m: ModelConfig, name: str) -> Any:
    """The value of model field `name` as it acts (0 read as the width it stands for)."""
    widths = {
        "moe_ffn_dim": m.expert_ffn_dim,
        "mla_kv_rank": m.kv_rank,
        "mla_rope_dim": m.rope_dim,
        "mla_nope_dim": m.nope_dim,
        "mla_v_dim": m.v_head_dim,
        "n_kv_heads": m.kv_heads,
    }
    return widths.get(name, getattr(m, name))


def moe_mismatches(hf: dict[str, Any], m: ModelConfig) -> list[str]:
    """How a MoE or DeepSeek config.json's own fields differ from the model, one phrase each."""
    kind = str(hf.get("model_type"))
    name = FAMILIES[kind].removesuffix("ForCausalLM")
    fields = {"attention": "mla" if kind in DEEPSEEK else "gqa"} | moe_fields(hf)
    found = refusals(hf)
    for field, theirs in fields.items():
        if field == "moe_balance":
            if not m.balance_bias:
                found.append(
                    f"{name} routes by a balancing bias (e_score_correction_bias), "
                    f"model.moe_balance={m.moe_balance} has none; use bias or both"
                )
        elif not same_value(theirs, _ours(m, field)):
            found.append(f"{name} has model.{field}={theirs!r}, this model {_ours(m, field)!r}")
    if m.balance_bias and "moe_balance" not in fields:
        found.append(f"model.moe_balance={m.moe_balance}: {name}'s router has no bias")
    return found


def config_mismatches(hf: dict[str, Any], m: ModelConfig) -> list[str]:
    """How config.json differs from the recipe's model, one phrase each."""
    found = []
    rope = hf.get("rope_parameters") or {}
    hf = {"rope_theta": rope.get("rope_theta"), **hf}
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        found.append(
            f"model_type {kind!r} is a family this trainer does not build; it loads "
            f"{', '.join(FAMILIES)}"
        )
    elif not same_family(kind, m):
        found.append(
            f"model_type {kind!r} there, {family(m)!r} here (model.qk_norm={m.qk_norm}, "
            f"model.attn_bias={m.attn_bias})"
        )
    if kind not in DEEPSEEK and hf_head_dim(hf) not in (None, m.head_dim):
        found.append(f"head_dim={hf_head_dim(hf)} there, model.head_dim={m.head_dim} here")
    if hf.get("use_sliding_window"):
        found.append("use_sliding_window=true there; Qwen's windows on some layers are not built")
    if kind in MOE_FAMILIES:
        found += moe_mismatches(hf, m)
    window = (hf.get("sliding_window") or 0) if kind in WINDOWED else 0
    if window != m.sliding_window:
        found.append(f"sliding_window={window} there, model.sliding_window={m.sliding_window} here")
    for key, ours in CONFIG_FIELDS.items():
        theirs = hf.get(key, False if key == "tie_word_embeddings" else None)
        if not same_value(theirs, getattr(m, ours)):
            found.append(f"{key}={theirs!r} there, model.{ours}={getattr(m, ours)!r} here")
    kv = hf.get("num_key_value_heads", hf.get("num_attention_heads"))
    if kind not in DEEPSEEK and kv != m.kv_heads:
        found.append(f"num_key_value_heads={kv!r} there, {m.kv_heads} key/value heads here")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            found.append(f"{key}=true there; this model has no output-projection or MLP biases")
    scaling = hf_rope_scaling(hf)
    if not same_scaling(scaling, dict(m.rope_scaling)):
        found.append(
            f"rope scaling {scaling or 'none'} there, model.rope_scaling="
            f"{dict(m.rope_scaling) or 'none'} here"
        )
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act={hf['hidden_act']!r} there; this model uses silu (SwiGLU)")
    if m.mlp != "swiglu":
        found.append(f"model.mlp={m.mlp} here; LlamaForCausalLM's MLP is SwiGLU (model.mlp=swiglu)")
    return found


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face directory (sharded ones through the index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        index_map = read_mapping(index, "a safetensors index (model.safetensors.index.json)")
        weight_map = mapping(index_map.get("weight_map"), index, "a weight_map of file names")
        names = {name for name in weight_map.values() if isinstance(name, str)}
        return sorted({folder / name for name in names})
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    return sorted(folder.glob("*.safetensors"))


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    expected = "a safetensors file"
    raw = read_span(path, expected, 0, 8)
    if len(raw) != 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", raw)
    if length > 100_000_000:
        raise ValueError(f"{path}: a {length}-byte header; not a safetensors file")
    try:
        header = json.loads(read_span(path, expected, 8, length))
    except (ValueError, RecursionError):
        raise ValueError(f"{path}: its header is not JSON; not a safetensors file") from None
    header = mapping(header, path, "a safetensors header (tensor name -> its dtype and shape)")
    header.pop("__metadata__", None)
    return header


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(folder):
        for name, info in safetensors_header(path).items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(type(n) is int for n in shape):
                raise ValueError(f"{path}: {name} has no shape (a list of whole numbers)")
            shapes[name] = tuple(shape)
    return shapes


def checkpoint_problems(folder: Path, m: ModelConfig) -> list[str]:
    """Why a Hugging Face directory cannot initialize the recipe's model (empty: it can)."""
    config = folder / "config.json"
    if not config.is_file():
        return [f"no config.json in {folder}"]
    try:
        hf = read_mapping(config, "a Hugging Face config.json")
    except ReadError as err:
        return [str(err)]
    problems = config_mismatches(hf, m)
    try:
        if not safetensors_files(folder):
            return [*problems, f"no *.safetensors files in {folder}"]
        shapes = tensor_shapes(folder)
    except (ValueError, KeyError, OSError) as exc:
        return [*problems, str(exc)]
    for ours, shape in expected_shapes(m).items():
        names = hf_names(ours, m)
        each = shape[1:] if ".experts." in ours else shape  # one tensor per expert
        for name in names:
            if name not in shapes:
                problems.append(f"{name} is missing (needed for {ours} {list(shape)})")
            elif shapes[name] != each:
                problems.append(
                    f"{name} is {list(shapes[name])} there, {ours} is {list(each)} here"
                )
    return problems
