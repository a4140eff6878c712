"""Load a DCP checkpoint whose vocabulary rows were padded for another tensor-parallel degree.

Under TP the embedding and LM head are padded to a multiple of tp (`parallel/tensor.py`), so
a checkpoint saved at tp=2 of a 511-token vocabulary holds 512 rows where tp=1 wants 511 and
tp=4 wants 512, and DCP refuses tensors whose global shapes differ. The padded rows are zero
and stay zero (never looked up, their logits masked, so no gradient and no optimizer state):
dropping them or adding zero rows changes nothing the model computes. Those entries (the
weights and their optimizer states) are read whole at their saved shape, cut or zero-padded
to the current one, and each rank copies its own shard in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pretrain.parallel.tensor import VOCAB_PARAMS


def _is_vocab_key(key: str) -> bool:
    """Whether a DCP key is a vocabulary weight ("model.output.weight") or one of its
    optimizer states ("optim.state.output.weight.exp_avg")."""
    for prefix in ("model.", "optim.state."):
        if key.startswith(prefix):
            fqn = key[len(prefix) :]
            return any(fqn == name or fqn.startswith(f"{name}.") for name in VOCAB_PARAMS)
    return False


@torch.no_grad()
def _copy_rows(target: torch.Tensor, saved: torch.Tensor) -> None:
    """Fill `target` (plain or a DTensor's local shard) from the full tensor `saved` whose
    first dim may be longer (rows dropped) or shorter (zero rows added)."""
    full = torch.zeros(target.shape, dtype=saved.dtype)
    rows = min(saved.shape[0], target.shape[0])
    full[:rows] = saved[:rows]
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        target.to_local().copy_(full[index])
    else:
        target.copy_(full)


def _resizable(
    state_dict: dict[str, Any], saved: dict[str, Any], prefix: str = ""
) -> list[tuple[dict[str, Any], str, str, torch.Tensor]]:
    """(container, key, dcp key, target) of every vocab tensor whose saved shape differs from
    its current one in the first dim only."""
    found = []
    for key, value in state_dict.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            found += _resizable(value, saved, f"{path}.")
            continue
        meta = saved.get(path)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(meta, TensorStorageMetadata)
            and _is_vocab_key(path)
            and tuple(meta.size) != tuple(value.shape)
            and tuple(meta.size[1:]) == tuple(value.shape[1:])
        ):
            found.append((state_dict, key, path, value))
    return found


def load_resizing_vocab(
    state_dict: dict[str, Any], path: Path, *, no_dist: bool = False
) -> list[str]:
    """`dcp.load(state_dict)` from the checkpoint at `path`, fitting vocabulary rows padded
    for another tp to the current size; returns the DCP keys that were resized."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    resized = _resizable(state_dict, saved)
    for container, key, dcp_key, _ in resized:
        meta = saved[dcp_key]
        # A plain tensor is read whole on every rank, whatever the saved sharding.
        container[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state_dict, checkpoint_id=str(path), no_dist=no_dist)
    for container, key, _, target in resized:
        _copy_rows(target, container[key])
        container[key] = target
    return [dcp_key for _, _, dcp_key, _ in resized]
