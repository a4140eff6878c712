"""Recipe rules for attention: multi-head latent attention (`model.attention=mla`) and the
rotary scaling (`model.rope_scaling`); no torch here."""

from __future__ import annotations

from pretrain.core.problems import Checks
from pretrain.core.schema import RecipeConfig

MLA_FIELDS = ("mla_q_rank", "mla_kv_rank", "mla_rope_dim", "mla_nope_dim", "mla_v_dim")
ROPE_SCALING_KEYS = {
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    ),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ("original_max_position_embeddings",)),
}
"""model.rope_scaling's rope_type -> (the keys it needs, the keys it may have)."""


def check_rope_scaling(c: Checks, cfg: RecipeConfig) -> None:
    """model.rope_scaling: a known rope_type with the keys it needs, each a positive number
    (truncate a boolean), and none it does not read."""
    m, at = cfg.model, "model.rope_scaling"
    scaling = dict(m.rope_scaling)
    if not scaling:
        return
    kind = scaling.pop("rope_type", None)
    if kind not in ROPE_SCALING_KEYS:
        c.add(
            f"{at}.rope_type",
            kind,
            "is not a rotary scaling this model computes",
            f"use one of {', '.join(ROPE_SCALING_KEYS)}, or model.rope_scaling={{}} for plain RoPE",
        )
        return
    needed, optional = ROPE_SCALING_KEYS[kind]
    for key in needed:
        if key not in scaling:
            c.add(f"{at}.{key}", None, f"rope_type {kind} needs it", f"give {at}.{key}")
    for key, value in scaling.items():
        if key not in needed + optional:
            c.add(
                f"{at}.{key}",
                value,
                f"rope_type {kind} does not read it",
                f"remove it; {kind} reads {', '.join(needed + optional)}",
            )
        elif key == "truncate":
            if not isinstance(value, bool):
                c.add(f"{at}.{key}", value, "must be true or false", f"set {at}.{key}=true")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            c.add(f"{at}.{key}", value, "must be a positive number", f"e.g. {at}.{key}=8.0")
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if (
        kind == "llama3"
        and isinstance(low, (int, float))
        and isinstance(high, (int, float))
        and high <= low
    ):
        c.add(
            f"{at}.high_freq_factor",
            high,
            f"must exceed low_freq_factor={low} (the band between them is interpolated)",
            "Llama 3.1 uses low_freq_factor=1.0, high_freq_factor=4.0",
        )


def check_attention(c: Checks, cfg: RecipeConfig, model_ok: bool) -> None:
    """Every attention rule `cfg` breaks; `model_ok` says whether head_dim is known to be
    sound."""
    check_rope_scaling(c, cfg)
    m = cfg.model
    if m.explicit_head_dim % 2 and not m.is_mla:
        c.add(
            "model.head_dim",
            m.explicit_head_dim,
            "rotary embedding turns pairs of dims; an odd head width has one left over",
            f"use an even width, e.g. {m.explicit_head_dim + 1}",
        )
    if c.at_least("model.sliding_window", m.sliding_window, 0) and m.sliding_window:
        if cfg.data.doc_mask:
            c.add(
                "data.doc_mask",
                True,
                f"with model.sliding_window={m.sliding_window}: the two masks are not combined",
                "set data.doc_mask=false, or model.sliding_window=0",
            )
        if cfg.parallel.cp > 1:
            c.add(
                "parallel.cp",
                cfg.parallel.cp,
                f"context parallelism's ring attends causally over whole chunks, not within "
                f"model.sliding_window={m.sliding_window}",
                "use parallel.cp=1, or model.sliding_window=0",
            )
    for name, family in (("qk_norm", "Qwen3"), ("attn_bias", "Qwen2")):
        if getattr(m, name) and m.is_mla:
            c.add(
                f"model.{name}",
                True,
                f"is a grouped-query attention option ({family}'s); multi-head latent "
                "attention normalizes its latents instead",
                f"set model.{name}=false, or model.attention=gqa",
            )
    if not m.is_mla:
        return
    ranks_ok = all([c.at_least(f"model.{f}", getattr(m, f), 0) for f in MLA_FIELDS])
    if m.n_kv_heads not in (0, m.n_heads):
        c.add(
            "model.n_kv_heads",
            m.n_kv_heads,
            "multi-head latent attention decompresses a key and a value for every query head "
            "from its latent; there are no key/value heads to group",
            f"set model.n_kv_heads=0 (or {m.n_heads}), or model.attention=gqa",
        )
    if not (model_ok and ranks_ok):
        return
    if m.rope_dim % 2:
        shown = m.mla_rope_dim if m.mla_rope_dim else "0 (head_dim / 2)"
        c.add(
            "model.mla_rope_dim",
            shown,
            f"rotary embedding turns pairs of dims; {m.rope_dim} is odd",
            f"use an even width, e.g. {m.rope_dim + 1}",
        )
