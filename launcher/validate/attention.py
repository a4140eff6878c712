"""Recipe rules for multi-head latent attention (`model.attention=mla`; no torch here)."""

from __future__ import annotations

from pretrain_core.problems import Checks
from pretrain_core.schema import RecipeConfig

MLA_FIELDS = ("mla_q_rank", "mla_kv_rank", "mla_rope_dim", "mla_nope_dim", "mla_v_dim")


def check_attention(c: Checks, cfg: RecipeConfig, model_ok: bool) -> None:
    """Every MLA rule `cfg` breaks; `model_ok` says whether head_dim is known to be sound."""
    m = cfg.model
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
