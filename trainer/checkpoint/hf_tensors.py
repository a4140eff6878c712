"""Our tensors as a Hugging Face family stores them and back, bit for bit: one name to
several (stacked experts, one tensor per expert), DeepSeek's interleaved rotary rows, and a
Qwen2-MoE shared expert that has no gate of its own (core/hf_llama.py and core/hf_moe.py
name them)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pretrain.core.hf_llama import family, hf_names
from pretrain.core.hf_moe import ROTARY_ROWS
from pretrain.core.model_config import ModelConfig


def _rotary_order(m: ModelConfig, rows: int) -> torch.Tensor:
    """Row order of a latent-attention weight with `rows` output rows that puts the rotary
    dims' pairs (interleaved, as DeepSeek keeps them) into split halves (as ours are)."""
    rope = m.rope_dim
    halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if rows == m.kv_rank + rope:  # the key latent: [kv_rank | rope]
        return torch.cat([torch.arange(m.kv_rank), m.kv_rank + halves])
    width = m.qk_head_dim  # each query head: [nope | rope]
    head = torch.cat([torch.arange(m.nope_dim), m.nope_dim + halves])
    return torch.cat([h * width + head for h in range(rows // width)])


def _is_rotary(name: str, m: ModelConfig) -> bool:
    """Whether a parameter's rows feed rotary dims (DeepSeek's family, latent attention)."""
    return m.is_mla and name.split(".", 2)[-1] in ROTARY_ROWS


def to_hf(name: str, tensor: torch.Tensor, m: ModelConfig) -> dict[str, torch.Tensor]:
    """One of our parameters (or balancing biases) as the Hugging Face tensor(s) of this
    model's family."""
    names = hf_names(name, m)
    if len(names) > 1 or ".experts." in name:  # stacked experts, one tensor each
        return {each: t.contiguous() for each, t in zip(names, tensor, strict=True)}
    if _is_rotary(name, m):
        tensor = tensor[torch.argsort(_rotary_order(m, tensor.shape[0]))]
    ungated = family(m) == "qwen2_moe" and not m.moe_shared_gate
    if ungated and name.endswith("feed_forward.shared.w2.weight"):
        # Qwen2-MoE's gate: sigmoid(0) = 0.5, taken back by a down projection twice as
        # large; both halving and doubling are exact in floating point.
        (gate,) = hf_names(name.replace("shared.w2", "shared_gate"), m)
        return {names[0]: tensor * 2, gate: tensor.new_zeros(1, tensor.shape[0])}
    return {names[0]: tensor.contiguous()}


def from_hf(
    name: str,
    read: Callable[[str], torch.Tensor],
    m: ModelConfig,
    interleaved: bool,
) -> torch.Tensor:
    """One of our parameters (or balancing biases) read from a Hugging Face checkpoint of
    this model's family through `read` (name -> tensor); `interleaved`: whether the folder's
    rotary dims are interleaved pairs (core.hf_moe.rotary_interleaved)."""
    names = hf_names(name, m)
    if len(names) > 1 or ".experts." in name:
        return torch.stack([read(each) for each in names])
    tensor = read(names[0])
    if interleaved and _is_rotary(name, m):
        tensor = tensor[_rotary_order(m, tensor.shape[0])]
    return tensor
