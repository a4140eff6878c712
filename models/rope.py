"""Rotary position embeddings: the frequency tables, with the scalings public checkpoints use
(`model.rope_scaling`, a mapping as in a Hugging Face config.json), and the rotation itself.

- llama3 (Llama 3.1-3.3): long wavelengths divided by `factor`, short ones kept, the band
  between `original_max_position_embeddings / high_freq_factor` and `/ low_freq_factor`
  interpolated smoothly.
- yarn (DeepSeek, Qwen long-context): frequencies interpolated by `factor` outside a band of
  dimensions set by `beta_fast`/`beta_slow`, and cos/sin scaled by the attention factor
  (0.1 ln(factor) + 1 unless given; `mscale`/`mscale_all_dim` as DeepSeek's configs say).
- linear: every frequency divided by `factor`.
- dynamic (NTK): the base grows only for sequences longer than the model's maximum length,
  which this model never runs, so the tables equal the plain ones.

The formulas follow transformers' own `ROPE_INIT_FUNCTIONS` (a unit test compares them),
computed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(s: Mapping[str, Any]) -> float:
    """The factor yarn scales cos and sin by."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s["factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    return mscale(factor)


def softmax_mscale(s: Mapping[str, Any] | None) -> float:
    """The factor DeepSeek's multi-head latent attention multiplies its softmax scale by
    under a scaled RoPE with `mscale_all_dim`: (0.1 mscale_all_dim ln(factor) + 1)^2, for
    every query and key dim, rotary or not (1 otherwise)."""
    s = s or {}
    factor, all_dim = s.get("factor") or 1.0, s.get("mscale_all_dim")
    if s.get("rope_type", "default") == "default" or not all_dim or factor <= 1:
        return 1.0
    return float((0.1 * all_dim * math.log(factor) + 1.0) ** 2)


def _yarn(inv_freq: torch.Tensor, s: Mapping[str, Any], dim: int, theta: float) -> torch.Tensor:
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: the plain frequency, 0: the interpolated one
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def inverse_frequencies(
    dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """The dim // 2 inverse frequencies (float64) of a rotary head `dim` wide under
    `scaling` (empty or None: plain RoPE), and the factor cos and sin are scaled by."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0  # type: ignore[arg-type]
    if kind == "yarn":
        return _yarn(inv_freq, scaling, dim, theta), yarn_attention_factor(scaling)  # type: ignore[arg-type]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0  # type: ignore[index]
    return inv_freq, 1.0  # default, and dynamic within max_seq_len


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of each (position, frequency): two float32 [max_seq_len, head_dim // 2]."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
    # float64 angles: they reach max_seq_len radians, where float32 rounding shows in the tables.
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = angles if device is None else angles.to(device)
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, head_dim] by position, in the half-split layout.

    The first and second halves of each head form the (real, imaginary) pairs, as in the
    Hugging Face Llama layout, so exported weights need no permutation.
    """
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)
