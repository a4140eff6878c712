"""Our tensors as a Hugging Face family stores them and back, bit for bit: one name to
several (stacked experts, one tensor per expert), DeepSeek's interleaved rotary rows, and a
Qwen2-MoE shared expert that has no gate of its own (core/hf/llama.py and core/hf/moe.py
name them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pretrain.core.hf.llama import family, hf_names
from pretrain.core.hf.moe import ROTARY_ROWS
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
    found, rotary = shard_to_hf(name, tensor, m)
    return {k: interleave_rows(t, m) if k in rotary else t.contiguous() for k, t in found.items()}


def interleave_rows(tensor: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """A latent-attention weight's rows in DeepSeek's order: rotary dims as interleaved pairs."""
    return tensor[torch.argsort(_rotary_order(m, tensor.shape[0]))]


def shard_to_hf(
    name: str, tensor: torch.Tensor, m: ModelConfig
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What `to_hf` gives for this rank's share of a parameter, but with rotary rows left in
    our order (the second part names the tensors whose rows `interleave_rows` orders): a
    sharded (DTensor) weight stays sharded under its Hugging Face name, a stacked expert
    weight gives the experts this rank holds."""
    names = hf_names(name, m)
    if len(names) > 1 or ".experts." in name:  # stacked experts, one tensor each
        first, held = _held_experts(tensor)
        return {names[first + j]: t for j, t in enumerate(held)}, set()
    ungated = family(m) == "qwen2_moe" and not m.moe_shared_gate
    if ungated and name.endswith("feed_forward.shared.w2.weight"):
        # Qwen2-MoE's gate: sigmoid(0) = 0.5, taken back by a down projection twice as
        # large; both halving and doubling are exact in floating point.
        (gate,) = hf_names(name.replace("shared.w2", "shared_gate"), m)
        zeros = torch.zeros(1, tensor.shape[0], dtype=tensor.dtype, device=tensor.device)
        return {names[0]: tensor * 2, gate: zeros}, set()
    return {names[0]: tensor}, set(names) if _is_rotary(name, m) else set()


def _held_experts(tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The first expert of a stacked expert weight this rank holds, and those it holds:
    expert and data parallelism split the experts' dim only, so each is held whole."""
    if not isinstance(tensor, DTensor):
        return 0, tensor
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(f"an expert weight split inside its experts: {tensor.placements}")
    return offset[0], tensor.to_local()


def from_hf(
    name: str,
    read: Callable[[str], torch.Tensor],
    m: ModelConfig,
    interleaved: bool,
) -> torch.Tensor:
    """One of our parameters (or balancing biases) read from a Hugging Face checkpoint of
    this model's family through `read` (name -> tensor); `interleaved`: whether the folder's
    rotary dims are interleaved pairs (core.hf.moe.rotary_interleaved)."""
    names = hf_names(name, m)
    if len(names) > 1 or ".experts." in name:
        return torch.stack([read(each) for each in names])
    tensor = read(names[0])
    if interleaved and _is_rotary(name, m):
        tensor = tensor[_rotary_order(m, tensor.shape[0])]
    return tensor
