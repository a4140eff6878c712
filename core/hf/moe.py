"""The Hugging Face layouts of our mixture-of-experts models and of multi-head latent
attention (no torch): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3.

Which family holds a model follows from its options (`moe_family`): latent attention is
DeepSeek's (V3 with a sigmoid router, V2 otherwise, also for a dense model whose layers all
stay dense through `first_k_dense_replace`); a grouped-query MoE model with query/key norms
is a Qwen3-MoE, one with shared experts or q/k/v biases a Qwen2-MoE, any other a Mixtral.
`export_problems` says what keeps a model out of its family; `refusals` what a config.json
states that no model here computes. Both are phrases, refused by name before anything runs.

Qwen2-MoE gates its shared expert (sigmoid of one linear unit: `model.moe_shared_gate`). A
model whose shared experts have no gate is still a Qwen2-MoE exactly: the exporter writes a
zero gate (sigmoid 0.5) and doubles the shared down projection, both exact in floating point
(trainer/checkpoint/hf_tensors.py). DeepSeek's rotary dims are interleaved pairs where ours
are split halves, so the rows of the query and latent projections that feed them are
permuted on the way in and out (`ROTARY_ROWS`; V3's `rope_interleave=false` needs none).
The latent norms of DeepSeek's attention use eps 1e-6 whatever `rms_norm_eps` says, and
ours use `model.norm_eps`, so a DeepSeek model needs norm_eps 1e-6.
"""

from __future__ import annotations

from typing import Any

from pretrain.core.model_config import ModelConfig

MOE_FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""config.json model_type -> architecture of the MoE and latent-attention families."""
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
LATENT_NORM_EPS = 1e-6
"""The eps of DeepSeek's q_a_layernorm and kv_a_layernorm (their modules' default)."""

MLA_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
"""Our latent attention's names after "layers.{i}." -> DeepSeek's after "model.layers.{i}."."""
ROTARY_ROWS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")
"""Latent-attention weights whose output rows include rotary dims (the last mla_rope_dim of
each query head; the last mla_rope_dim of the key latent)."""
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Our stacked expert weights -> the per-expert projections of Qwen-MoE and DeepSeek."""
MIXTRAL_NAMES = {"feed_forward.router.weight": "block_sparse_moe.gate.weight"}


def moe_family(m: ModelConfig) -> str | None:
    """The family that holds a MoE or latent-attention model (None: a dense GQA model)."""
    if m.is_mla:
        return "deepseek_v3" if m.moe_experts and m.moe_router == "sigmoid" else "deepseek_v2"
    if not m.moe_experts:
        return None
    if m.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if m.moe_shared_experts or m.attn_bias else "mixtral"


def _moe_names(kind: str) -> dict[str, str]:
    if kind == "mixtral":
        return MIXTRAL_NAMES
    shared = "mlp.shared_expert" if kind == "qwen2_moe" else "mlp.shared_experts"
    return {
        "feed_forward.router.weight": "mlp.gate.weight",
        "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
        "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
        **{
            f"feed_forward.shared.{ours}.weight": f"{shared}.{theirs}.weight"
            for ours, theirs in EXPERT_PROJECTIONS.items()
        },
    }


def block_names(rest: str, index: str, m: ModelConfig) -> list[str] | None:
    """The Hugging Face tensors (after "model.layers.{index}.") of our `rest` (after
    "layers.{index}.") in this model's MoE or latent-attention family: one per expert for a
    stacked expert weight. None: a name the dense families share."""
    kind = moe_family(m)
    if kind is None:
        return None
    if kind in DEEPSEEK and rest in MLA_NAMES:
        return [MLA_NAMES[rest]]
    stacked, _, weight = rest.rpartition(".")
    if stacked == "feed_forward.experts" and weight in EXPERT_PROJECTIONS:
        if kind == "mixtral":
            each = f"block_sparse_moe.experts.{{}}.{weight}.weight"
        else:
            each = f"mlp.experts.{{}}.{EXPERT_PROJECTIONS[weight]}.weight"
        return [each.format(j) for j in range(m.moe_experts)]
    names = _moe_names(kind)
    return [names[rest]] if rest in names else None


def mla_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our latent attention's parameter names (after "layers.{i}.") and shapes."""
    h, heads = m.dim, m.n_heads
    q = heads * m.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if m.mla_q_rank:
        shapes["attention.wq_a.weight"] = (m.mla_q_rank, h)
        shapes["attention.q_norm.weight"] = (m.mla_q_rank,)
        shapes["attention.wq_b.weight"] = (q, m.mla_q_rank)
    else:
        shapes["attention.wq.weight"] = (q, h)
    shapes["attention.wkv_a.weight"] = (m.kv_rank + m.rope_dim, h)
    shapes["attention.kv_norm.weight"] = (m.kv_rank,)
    shapes["attention.wkv_b.weight"] = (heads * (m.nope_dim + m.v_head_dim), m.kv_rank)
    shapes["attention.wo.weight"] = (h, heads * m.v_head_dim)
    return shapes


def moe_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A MoE layer's parameter (and balancing bias) names after "layers.{i}." and shapes."""
    e, h, ffn = m.moe_experts, m.dim, m.expert_ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "feed_forward.router.weight": (e, h),
        "feed_forward.experts.w1": (e, ffn, h),
        "feed_forward.experts.w3": (e, ffn, h),
        "feed_forward.experts.w2": (e, h, ffn),
    }
    if m.moe_shared_experts:
        width = m.moe_shared_experts * ffn
        shapes |= {
            "feed_forward.shared.w1.weight": (width, h),
            "feed_forward.shared.w3.weight": (width, h),
            "feed_forward.shared.w2.weight": (h, width),
        }
        if m.moe_shared_gate:
            shapes["feed_forward.shared_gate.weight"] = (1, h)
    if m.balance_bias:
        shapes["feed_forward.expert_bias"] = (e,)
    return shapes


def rotary_interleaved(hf: dict[str, Any]) -> bool:
    """Whether a config.json's rotary dims are interleaved pairs (DeepSeek's layout)."""
    kind = hf.get("model_type")
    return kind == "deepseek_v2" or (kind == "deepseek_v3" and hf.get("rope_interleave", True))


def _qwen_layers(hf: dict[str, Any]) -> str | None:
    """model.moe_layers of a Qwen-MoE's decoder_sparse_step and mlp_only_layers (None: no
    policy here picks those layers)."""
    step, dense = int(hf.get("decoder_sparse_step") or 1), list(hf.get("mlp_only_layers") or [])
    if step == 1:
        n = len(dense)
        return None if dense != list(range(n)) else (f"after:{n}" if n else "all")
    return f"every:{step}" if not dense else None


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The model.* fields a MoE or DeepSeek config.json states beyond the dense ones (empty
    for another family): what `init.from_hf` adopts and what a model must equal."""
    kind = hf.get("model_type")
    if kind == "mixtral":
        return {
            "moe_experts": hf.get("num_local_experts", 8),
            "moe_top_k": hf.get("num_experts_per_tok", 2),
            "moe_ffn_dim": hf.get("intermediate_size"),
            **_plain_router(normalize=True),
            "moe_shared_experts": 0,
            "moe_layers": "all",
        }
    if kind in ("qwen2_moe", "qwen3_moe"):
        ffn = hf.get("moe_intermediate_size") or 0
        shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
        return {
            "qk_norm": kind == "qwen3_moe",
            "attn_bias": bool(hf.get("qkv_bias", True)) if kind == "qwen2_moe" else False,
            "moe_experts": hf.get("num_experts") or hf.get("num_local_experts") or 0,
            "moe_top_k": hf.get("num_experts_per_tok"),
            "moe_ffn_dim": ffn,
            **_plain_router(normalize=bool(hf.get("norm_topk_prob", False))),
            "moe_shared_experts": shared // ffn if ffn else 0,
            "moe_shared_gate": bool(shared),
            "moe_layers": _qwen_layers(hf) or "all",
        }
    if kind in DEEPSEEK:
        return _deepseek_fields(hf, kind)
    return {}


def _plain_router(normalize: bool) -> dict[str, Any]:
    return {
        "moe_router": "softmax",
        "moe_normalize_topk": normalize,
        "moe_route_scale": 1.0,
        "moe_node_limit": 0,
        "moe_groups": 0,
    }


def _deepseek_fields(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    dense = int(hf.get("first_k_dense_replace") or 0)
    moe = dense < int(hf.get("num_hidden_layers", 0))
    fields: dict[str, Any] = {
        "attention": "mla",
        "n_kv_heads": hf.get("num_attention_heads"),  # a key and a value per query head
        "qk_norm": False,
        "attn_bias": False,
        "mla_q_rank": hf.get("q_lora_rank", 1536) or 0,
        "mla_kv_rank": hf.get("kv_lora_rank", 512),
        "mla_rope_dim": hf.get("qk_rope_head_dim", 64),
        "mla_nope_dim": hf.get("qk_nope_head_dim", 128),
        "mla_v_dim": hf.get("v_head_dim", 128),
        "moe_experts": hf.get("n_routed_experts", 0) if moe else 0,
    }
    if not moe:
        return fields
    fields |= {
        "moe_top_k": hf.get("num_experts_per_tok"),
        "moe_ffn_dim": hf.get("moe_intermediate_size"),
        "moe_shared_experts": hf.get("n_shared_experts") or 0,
        "moe_shared_gate": False,
        "moe_layers": f"after:{dense}" if dense else "all",
        "moe_route_scale": float(hf.get("routed_scaling_factor", 1.0)),
    }
    if kind == "deepseek_v2":
        # transformers' DeepseekV2 renormalizes nothing (norm_topk_prob is refused).
        return fields | {**_plain_router(False), "moe_route_scale": fields["moe_route_scale"]}
    groups = int(hf.get("n_group") or 1)
    limit = int(hf.get("topk_group") or groups)
    limited = limit < groups
    return fields | {
        "moe_router": "sigmoid",
        "moe_normalize_topk": bool(hf.get("norm_topk_prob", True)),
        "moe_balance": "bias",  # e_score_correction_bias: aux-loss-free balancing
        "moe_groups": groups if limited else 0,
        "moe_node_limit": limit if limited else 0,
    }


def refusals(hf: dict[str, Any]) -> list[str]:
    """What a MoE or DeepSeek config.json states that no model here computes."""
    kind, found = hf.get("model_type"), []
    if kind in ("qwen2_moe", "qwen3_moe"):
        ffn = hf.get("moe_intermediate_size") or 0
        shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
        if ffn and shared % ffn:
            found.append(
                f"shared_expert_intermediate_size={shared} there is not a whole number of "
                f"experts of moe_intermediate_size={ffn} (model.moe_shared_experts)"
            )
        if _qwen_layers(hf) is None:
            found.append(
                f"decoder_sparse_step={hf.get('decoder_sparse_step')} with mlp_only_layers="
                f"{hf.get('mlp_only_layers')} there; model.moe_layers picks all, every:K or "
                "after:N layers"
            )
    if kind in DEEPSEEK:
        found += _deepseek_refusals(hf, kind)
    return found


def _deepseek_refusals(hf: dict[str, Any], kind: str) -> list[str]:
    found = []
    eps = hf.get("rms_norm_eps", LATENT_NORM_EPS)
    if eps != LATENT_NORM_EPS:
        found.append(
            f"rms_norm_eps={eps} there, and DeepSeek's latent norms use {LATENT_NORM_EPS} "
            "where this model's use model.norm_eps"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        found.append(
            f"moe_layer_freq={hf['moe_layer_freq']} there; DeepSeek's layers here are dense "
            "then MoE (first_k_dense_replace)"
        )
    groups, limit = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    greedy = hf.get("topk_method") == "group_limited_greedy"
    if kind == "deepseek_v2" and greedy and limit < groups:
        found.append(
            f"topk_method=group_limited_greedy with topk_group={limit} of n_group={groups} "
            "there: DeepSeek-V2 scores a group by its best expert, this router by the sum of "
            "its two best (DeepSeek-V3's)"
        )
    top_k = hf.get("num_experts_per_tok") or 1
    if kind == "deepseek_v2" and hf.get("norm_topk_prob") and top_k > 1:
        found.append(
            "norm_topk_prob=true there, which DeepSeek's own code applies and transformers' "
            "DeepseekV2 ignores; the two compute different models"
        )
    experts = hf.get("n_routed_experts") or 0
    if kind == "deepseek_v3" and experts and experts % groups:
        found.append(f"n_group={groups} there does not divide n_routed_experts={experts}")
    return found


def export_problems(m: ModelConfig, groups: int) -> list[str]:
    """Why this model cannot be written as its `moe_family` (empty when it can); `groups` are
    the expert groups its router limited each token to (1 without a limit)."""
    kind = moe_family(m)
    if kind is None:
        return []
    name = MOE_FAMILIES[kind].removesuffix("ForCausalLM")
    if kind in DEEPSEEK:
        return _deepseek_problems(m, kind, name)
    found = []
    if m.moe_router != "softmax":
        found.append(
            f"model.moe_router={m.moe_router}: {name}'s router is a softmax (a sigmoid router "
            "is DeepSeek-V3's, with latent attention)"
        )
    if m.moe_route_scale != 1:
        found.append(
            f"model.moe_route_scale={m.moe_route_scale}: {name} weighs the routed experts by "
            "their scores as they are"
        )
    if m.balance_bias:
        found.append(
            f"model.moe_balance={m.moe_balance}: the per-expert balancing bias decides which "
            f"experts a token runs through, and {name}'s router has no such bias; export a "
            "model trained with model.moe_balance=aux"
        )
    if m.moe_node_limit:
        found.append(
            f"model.moe_node_limit={m.moe_node_limit}: each token's experts come from its best "
            f"expert groups only, and {name}'s router takes the top-k of all experts; export a "
            "model trained with model.moe_node_limit=0"
        )
    if kind != "mixtral" and m.sliding_window:
        found.append(
            f"model.sliding_window={m.sliding_window}: {name}'s windows are per layer "
            "(use_sliding_window), not built here; Mixtral has one window for all layers"
        )
    if kind == "qwen3_moe" and m.moe_shared_experts:
        found.append(
            f"model.moe_shared_experts={m.moe_shared_experts}: Qwen3-MoE (the MoE family with "
            "query/key norms) has no shared experts"
        )
    if kind == "mixtral":
        found += _mixtral_problems(m)
    return found


def _mixtral_problems(m: ModelConfig) -> list[str]:
    found = []
    if m.n_moe_layers != m.n_layers:
        found.append(
            f"model.moe_layers={m.moe_layers}: {m.n_layers - m.n_moe_layers} of {m.n_layers} "
            "layers are dense, and every Mixtral layer is MoE (Qwen2-MoE, with dense layers, "
            "has a shared expert); export a model with model.moe_layers=all"
        )
    if not m.moe_normalize_topk:
        found.append(
            "model.moe_normalize_topk=false: Mixtral weighs the top-k experts by their softmax "
            "scores renormalized to sum to 1 (Qwen2-MoE, which may not, has a shared expert)"
        )
    return found


def _deepseek_problems(m: ModelConfig, kind: str, name: str) -> list[str]:
    found = []
    if m.norm_eps != LATENT_NORM_EPS:
        found.append(
            f"model.norm_eps={m.norm_eps}: DeepSeek's latent norms use {LATENT_NORM_EPS} "
            "whatever its rms_norm_eps, and this model's latent norms use model.norm_eps; "
            f"train with model.norm_eps={LATENT_NORM_EPS}"
        )
    if m.n_heads and m.dim % m.n_heads:
        found.append(
            f"model.dim={m.dim} is not a multiple of model.n_heads={m.n_heads}, which {name}'s "
            "config requires"
        )
    if m.sliding_window:
        found.append(
            f"model.sliding_window={m.sliding_window}: {name} attends to every earlier token"
        )
    if not m.moe_experts:
        return found
    policy, _, arg = m.moe_layers.partition(":")
    if policy == "every" and arg != "1":
        found.append(
            f"model.moe_layers={m.moe_layers}: {name}'s layers are dense then MoE "
            "(first_k_dense_replace); use all or after:N"
        )
    if not m.moe_shared_experts:
        found.append(f"model.moe_shared_experts=0: every {name} MoE layer has shared experts")
    if m.moe_shared_gate:
        found.append(f"model.moe_shared_gate=true: {name}'s shared experts have no gate")
    if kind == "deepseek_v3":
        return found
    if m.moe_normalize_topk:
        found.append(
            "model.moe_normalize_topk=true with a softmax router: transformers' DeepseekV2 "
            "does not renormalize the top-k weights, and DeepseekV3 routes by sigmoid; export "
            "a model trained with model.moe_normalize_topk=false"
        )
    if m.balance_bias:
        found.append(
            f"model.moe_balance={m.moe_balance}: DeepSeek-V2's router has no balancing bias "
            "(DeepSeek-V3's sigmoid router has)"
        )
    if m.moe_node_limit:
        found.append(
            f"model.moe_node_limit={m.moe_node_limit}: DeepSeek-V2 scores an expert group by "
            "its best expert, this router by the sum of its two best (DeepSeek-V3's, whose "
            "router is a sigmoid)"
        )
    return found


def moe_config(m: ModelConfig, groups: int) -> dict[str, Any]:
    """config.json's keys of this model's MoE or DeepSeek family beyond the dense ones
    (`groups`: the expert groups its router limits each token to; 1 without a limit)."""
    kind = moe_family(m)
    if kind is None:
        return {}
    top = {"architectures": [MOE_FAMILIES[kind]], "model_type": kind}
    if kind == "mixtral":
        return top | {
            "intermediate_size": m.expert_ffn_dim,
            "num_local_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k,
            "router_aux_loss_coef": m.moe_aux_loss_coef,
            "sliding_window": m.sliding_window or None,
        }
    dense = [i for i in range(m.n_layers) if not m.is_moe_layer(i)]
    if kind in ("qwen2_moe", "qwen3_moe"):
        policy, _, arg = m.moe_layers.partition(":")
        every = policy == "every"
        found = top | {
            "num_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k,
            "moe_intermediate_size": m.expert_ffn_dim,
            "norm_topk_prob": m.moe_normalize_topk,
            "decoder_sparse_step": int(arg) if every else 1,
            "mlp_only_layers": [] if every else dense,
            "router_aux_loss_coef": m.moe_aux_loss_coef,
            "use_sliding_window": False,
        }
        if kind == "qwen2_moe":
            found["shared_expert_intermediate_size"] = m.moe_shared_experts * m.expert_ffn_dim
            found["qkv_bias"] = m.attn_bias
        return found
    return top | _deepseek_config(m, kind, len(dense) if m.moe_experts else m.n_layers, groups)


def _deepseek_config(m: ModelConfig, kind: str, dense: int, groups: int) -> dict[str, Any]:
    found = {
        "num_key_value_heads": m.n_heads,
        "q_lora_rank": m.mla_q_rank or None,
        "kv_lora_rank": m.kv_rank,
        "qk_rope_head_dim": m.rope_dim,
        "qk_nope_head_dim": m.nope_dim,
        "v_head_dim": m.v_head_dim,
        "first_k_dense_replace": dense,
        "n_routed_experts": m.moe_experts,
        "n_shared_experts": m.moe_shared_experts,
        "moe_intermediate_size": m.expert_ffn_dim,
        "num_experts_per_tok": m.moe_top_k,
        "routed_scaling_factor": m.moe_route_scale,
        "norm_topk_prob": m.moe_normalize_topk,
    }
    if kind == "deepseek_v2":
        return found | {"topk_method": "greedy", "n_group": None, "topk_group": None}
    groups = m.moe_groups or groups  # the model's own, else those the layout gave
    limit = m.moe_node_limit or groups
    return found | {"n_group": groups, "topk_group": limit, "rope_interleave": True}
