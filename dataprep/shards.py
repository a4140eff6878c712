"""Token shards of one work unit, written atomically, and the unit's done marker.

A unit's documents (each followed by the end-of-sequence token) go to parts of at most
`shard_tokens` tokens, cut between documents: `uNNNNNN.PPP.bin` (the ids, flat) and
`uNNNNNN.PPP.docs.npy` (int64 [documents, 2]: the cumulative token end and text-byte end of
each document). Each file is written as `.tmp` and renamed when complete; the marker
`uNNNNNN.json`, written last, says the unit is done and what it holds. A stopped
preparation leaves only `.tmp` files and units without markers, which a resume redoes.

This module runs inside the worker processes: numpy and tokenizers, no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.core.inputs.reading import ReadError, read_mapping
from pretrain.core.schema import SourceConfig
from pretrain.dataprep.corpus import Unit, unit_documents

SHARD_TOKENS = 1 << 28
"""Tokens per shard part at most (512 MiB of uint16), unless one document is longer."""

ProgressFn = Callable[[int, int, int], None]
"""Called with (documents, tokens, text bytes) just tokenized."""


def marker_path(folder: Path, index: int) -> Path:
    """The done marker of unit `index`."""
    return folder / f"u{index:06d}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so readers see the old file or the complete new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_marker(folder: Path, unit: Unit) -> dict[str, Any] | None:
    """The record of a finished unit, None if it is not done (or was another unit)."""
    path = marker_path(folder, unit.index)
    try:
        record = read_mapping(path, "a finished unit's marker")
    except ReadError:
        return None  # missing, or cut short by a crash: the unit is done again
    parts = record.get("parts")
    if not isinstance(parts, list) or not all(_part_ok(folder, p) for p in parts):
        return None
    if type(record.get("max_token_id")) is not int:
        return None
    return record if record.get("unit") == unit.spec() else None


def _part_ok(folder: Path, part: Any) -> bool:
    """Whether a marker's part names its files, which exist, and counts them."""
    if not isinstance(part, dict) or not isinstance(part.get("file"), str):
        return False
    counts = ("tokens", "documents", "text_bytes")
    if not isinstance(part.get("docs"), str) or any(type(part.get(k)) is not int for k in counts):
        return False
    return (folder / str(part["file"])).is_file()


@dataclass
class PartWriter:
    """Appends documents to the unit's current part, starting a new one when it is full."""

    folder: Path
    unit: int
    dtype: np.dtype
    shard_tokens: int
    parts: list[dict[str, Any]] = field(default_factory=list)
    max_token_id: int = -1
    _file: Any = None
    _ends: list[tuple[int, int]] = field(default_factory=list)
    _tokens: int = 0
    _bytes: int = 0

    def _name(self) -> str:
        return f"u{self.unit:06d}.{len(self.parts):03d}"

    def add(self, ids: np.ndarray, text_bytes: int) -> None:
        """One document's ids (EOS included) and the bytes of its text."""
        if self._file is None:
            # Open across add() calls until the part is full: closed in close_part.
            self._file = open(self.folder / f"{self._name()}.bin.tmp", "wb")  # noqa: SIM115
        self._file.write(ids.astype(self.dtype, copy=False).tobytes())
        self._tokens += len(ids)
        self._bytes += text_bytes
        self._ends.append((self._tokens, self._bytes))
        if len(ids):
            self.max_token_id = max(self.max_token_id, int(ids.max()))
        if self._tokens >= self.shard_tokens:
            self.close_part()

    def close_part(self) -> None:
        """Finish the current part: flush, write its document index, rename both."""
        if self._file is None:
            return
        name = self._name()
        self._file.close()
        self._file = None
        docs = self.folder / f"{name}.docs.npy"
        with open(docs.with_name(docs.name + ".tmp"), "wb") as f:
            np.save(f, np.asarray(self._ends, dtype=np.int64).reshape(-1, 2))
        os.replace(docs.with_name(docs.name + ".tmp"), docs)
        os.replace(self.folder / f"{name}.bin.tmp", self.folder / f"{name}.bin")
        self.parts.append(
            {
                "file": f"{name}.bin",
                "docs": docs.name,
                "tokens": self._tokens,
                "documents": len(self._ends),
                "text_bytes": self._bytes,
            }
        )
        self._ends, self._tokens, self._bytes = [], 0, 0


@dataclass(frozen=True)
class UnitJob:
    """What a worker needs to tokenize one unit (picklable)."""

    source: SourceConfig
    unit: Unit
    folder: str
    dtype: str
    shard_tokens: int = SHARD_TOKENS


def tokenize_unit(job: UnitJob, tokenizer: Any, eos: int, progress: ProgressFn) -> dict[str, Any]:
    """Tokenize the unit's documents into its parts and write its marker; its record."""
    folder = Path(job.folder)
    writer = PartWriter(folder, job.unit.index, np.dtype(job.dtype), job.shard_tokens)
    for texts in unit_documents(job.source, job.unit):
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        tokens = text_bytes = 0
        for text, encoding in zip(texts, encodings, strict=True):
            ids = np.fromiter((*encoding.ids, eos), dtype=np.int64, count=len(encoding.ids) + 1)
            nbytes = len(text.encode("utf-8"))
            writer.add(ids, nbytes)
            tokens += len(ids)
            text_bytes += nbytes
        progress(len(texts), tokens, text_bytes)
    writer.close_part()
    record = {
        "unit": job.unit.spec(),
        "parts": writer.parts,
        "tokens": sum(p["tokens"] for p in writer.parts),
        "documents": sum(p["documents"] for p in writer.parts),
        "text_bytes": sum(p["text_bytes"] for p in writer.parts),
        "max_token_id": writer.max_token_id,
    }
    write_json_atomic(marker_path(folder, job.unit.index), record)
    return record


_WORKER: dict[str, Any] = {}


def init_worker(tokenizer_path: str, eos: int, queue: Any) -> None:
    """Pool initializer: one single-threaded tokenizer per worker process."""
    # The workers are the parallelism; the tokenizer's own threads would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_file(tokenizer_path), eos=eos, queue=queue)


def run_in_worker(job: UnitJob) -> dict[str, Any]:
    """`tokenize_unit` with the worker's tokenizer, reporting progress on its queue."""
    queue = _WORKER["queue"]
    return tokenize_unit(
        job, _WORKER["tokenizer"], _WORKER["eos"], lambda *counts: queue.put(counts)
    )
