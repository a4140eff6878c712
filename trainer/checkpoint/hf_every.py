"""`checkpoint.hf_every=N`: every N steps the ranks write the model as a Hugging Face folder,
RUN_DIR/hf/step_N, straight from their shards; the model is never gathered on one rank.

1. Each rank names its tensors as the model's family does (`hf_tensors.shard_to_hf`): a
   sharded (DTensor) weight stays sharded under its Hugging Face name, a stacked expert weight
   gives the experts this rank holds whole (expert and data parallelism split the experts'
   dim only), a replicated one is written once.
2. torch.distributed.checkpoint writes each rank's shards as safetensors files
   (`HuggingFaceStorageWriter`, one file per rank, under step_N.tmp/sharded).
3. The ranks consolidate them (`consolidate_safetensors_files_on_every_rank`): each
   `model-0000i-of-0000n.safetensors` is assembled by one rank, one tensor in memory at a
   time, and rank 0 writes `model.safetensors.index.json`.
4. Each rank puts the rows DeepSeek keeps interleaved in order, in place, in the files it
   assembled.
5. Rank 0 adds config.json, generation_config.json and the tokenizer, removes the shards and
   renames step_N.tmp to step_N: a folder is complete once renamed (a crash leaves a .tmp,
   removed by the next save). The newest `checkpoint.keep` folders are kept.

It runs between steps on the ranks (training waits), as a synchronous checkpoint does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)

from pretrain.core.inputs.reading import read_mapping
from pretrain.core.run.checkpoint_files import step_dir
from pretrain.core.run.rundir import HF_DIR
from pretrain.core.schema import RecipeConfig
from pretrain.trainer.checkpoint.export import run_tokenizer, write_hf_config
from pretrain.trainer.checkpoint.hf_tensors import interleave_rows, shard_to_hf

FILE_BYTES = 4 << 30
"""Most bytes of one safetensors file; the files are at least as many as the ranks (up to
the tensors) so that every rank assembles some."""


def hf_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete Hugging Face folders a run wrote, oldest first."""
    root = Path(run_dir) / HF_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name, _, step = path.name.partition("_")
        if name == "step" and step.isdigit() and (path / "config.json").is_file():
            found.append((int(step), path))
    return sorted(found)


class HFWriter:
    """Writes a run's Hugging Face folders (`checkpoint.hf_every`); every rank makes the same
    calls."""

    def __init__(
        self, run_dir: Path, cfg: RecipeConfig, state_dict: Callable[[], dict[str, Any]]
    ) -> None:
        self.root = Path(run_dir) / HF_DIR
        self.cfg = cfg
        self.state_dict = state_dict
        """The model's state keyed by the plain model's names (sharded as the layout holds it)."""

    def due(self, step: int) -> bool:
        """Whether a folder is written after `step`."""
        every = self.cfg.checkpoint.hf_every
        return every > 0 and step % every == 0

    def save(self, step: int) -> Path:
        """Write RUN_DIR/hf/step_N; collective. Returns the folder."""
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        rank = dist.get_rank()
        if rank == 0:
            for stale in self.root.glob("step_*.tmp"):  # saves that crashed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        tensors, rotary = self._tensors()
        # A collective: no rank writes into tmp before rank 0 has made it afresh.
        sizes, rotary = _gathered(tensors, rotary)
        files = _files(sizes, dist.get_world_size())
        dcp.save(
            tensors,
            storage_writer=HuggingFaceStorageWriter(str(tmp / "sharded"), save_distributed=True),
        )
        consolidate_safetensors_files_on_every_rank(str(tmp / "sharded"), str(tmp), files)
        mine = {name for name, index in files.items() if index % dist.get_world_size() == rank}
        _interleave_in_files(tmp, sorted(rotary & mine), self.cfg)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp / "sharded")
            write_hf_config(tmp, self.cfg, run_tokenizer(self.cfg))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for _, old in hf_folders(self.root.parent)[: -self.cfg.checkpoint.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def _tensors(self) -> tuple[dict[str, torch.Tensor], set[str]]:
        """This rank's share of the Hugging Face tensors, and which hold rotary rows."""
        m = self.cfg.model
        tensors: dict[str, torch.Tensor] = {}
        rotary: set[str] = set()
        for name, tensor in self.state_dict().items():
            if name == "output.weight" and m.tie_embeddings:
                continue  # Hugging Face ties lm_head to embed_tokens itself
            found, rows = shard_to_hf(name, tensor, m)
            tensors |= found
            rotary |= rows
        return tensors, rotary


def _gathered(
    tensors: dict[str, torch.Tensor], rotary: set[str]
) -> tuple[dict[str, int], set[str]]:
    """Every rank's tensors with their bytes (whole tensors: a DTensor's shape is global),
    and every rank's tensors with rotary rows."""
    mine = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, (mine, sorted(rotary)))
    sizes = {name: size for each, _ in found for name, size in each.items()}
    return sizes, {name for _, each in found for name in each}


def _files(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Each tensor's file, 1..n: the largest tensors first into the emptiest file, with n the
    ranks (each assembles the files of its index modulo the ranks) or as many as keep a file
    under FILE_BYTES, no more than the tensors."""
    n = min(len(sizes), max(ranks, math.ceil(sum(sizes.values()) / FILE_BYTES)))
    filled = [0] * n
    files = {}
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        index = min(range(n), key=lambda i: filled[i])
        filled[index] += sizes[name]
        files[name] = index + 1
    return files


def _interleave_in_files(folder: Path, names: list[str], cfg: RecipeConfig) -> None:
    """Put the rows of the tensors `names` (in the folder's assembled files) in DeepSeek's
    interleaved rotary order, in place: same bytes, other order."""
    if not names:
        return
    index = read_mapping(folder / "model.safetensors.index.json", "a safetensors index")[
        "weight_map"
    ]
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name], []).append(name)
    for file, held in by_file.items():
        path = folder / file
        with path.open("r+b") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            for name in held:
                info = header[name]
                start, end = info["data_offsets"]
                f.seek(8 + length + start)
                dtype = getattr(torch, _DTYPES[info["dtype"]])
                raw = bytearray(f.read(end - start))
                tensor = torch.frombuffer(raw, dtype=dtype).view(info["shape"])
                f.seek(8 + length + start)
                ordered = interleave_rows(tensor, cfg.model).contiguous()
                f.write(ordered.view(torch.uint8).numpy().tobytes())


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
"""safetensors' dtype names -> torch's, for the weights a model holds."""
