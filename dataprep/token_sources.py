"""Pre-tokenized sources read in place: nanoGPT token files and Megatron indexed datasets.

Preparing one writes no tokens: the manifest names the source's .bin itself (by absolute
path, its dtype and where its tokens start) beside a document index written here, so a
5 TB Megatron dataset is used where it lies. Documents are those of Megatron's document
index; in a nanoGPT file they end at each end-of-sequence token when the recipe's tokenizer
has one (else the file is one document). The largest id is scanned once, so a vocabulary
too small for the data is refused before training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pretrain.dataprep.sources import DatasetPlace, megatron_prefix, token_files
from pretrain.dataprep.token_formats import (
    FormatError,
    nanogpt_vocab,
    read_megatron_header,
)

SCAN_TOKENS = 1 << 26
"""Tokens scanned at once for the largest id and the end-of-sequence positions."""


def _scan(tokens: np.ndarray, eos: int | None) -> tuple[int, np.ndarray]:
    """The largest id, and the positions just after each EOS (document ends)."""
    top, ends = -1, []
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        top = max(top, int(chunk.max()))
        if eos is not None:
            ends.append(np.flatnonzero(chunk == eos) + start + 1)
    found = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    return top, found.astype(np.int64)


def _nanogpt(path: Path, vocab_size: int, eos: int | None) -> dict[str, Any]:
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top, ends = _scan(tokens, eos)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))  # text after the last EOS is a document too
    return {
        "dtype": "uint16",
        "offset": 0,
        "tokens": len(tokens),
        "ends": ends,
        "max_token_id": top,
        "vocab_size": nanogpt_vocab(path, vocab_size),
    }


def _megatron(prefix: Path) -> dict[str, Any]:
    idx = Path(f"{prefix}.idx")
    header = read_megatron_header(idx)
    n, m, at = header.sequences, header.document_indices, header.arrays_offset
    sizes = np.memmap(idx, dtype=np.int32, mode="r", offset=at, shape=(n,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=at + 4 * n, shape=(n,))
    documents = np.memmap(idx, dtype=np.int64, mode="r", offset=at + 12 * n, shape=(m,))
    item = header.itemsize
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]]) * item
    if not np.array_equal(np.asarray(pointers), starts):
        raise FormatError(f"{idx}: its sequences are not stored back to back in {prefix}.bin")
    total = int(sizes.sum(dtype=np.int64))
    bin_path = Path(f"{prefix}.bin")
    if bin_path.stat().st_size < total * item:
        raise FormatError(f"{bin_path}: shorter than the {total} tokens its index lists")
    cumulative = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    ends = cumulative[np.asarray(documents[1:])]
    ends = ends[np.concatenate([[True], np.diff(ends) > 0])] if len(ends) else ends
    tokens = np.memmap(bin_path, dtype=header.dtype, mode="r", shape=(total,))
    top, _ = _scan(tokens, None)
    return {
        "dtype": header.dtype,
        "offset": 0,
        "tokens": total,
        "ends": ends[ends > 0].astype(np.int64),
        "max_token_id": top,
        "vocab_size": 0,
    }


def token_shard(place: DatasetPlace, eos: int | None) -> dict[str, Any]:
    """The one shard of a pre-tokenized source (its file, dtype, tokens, document ends),
    with the largest id it holds and its vocabulary (0 when unknown)."""
    src = place.source
    if place.kind == "megatron":
        prefix = megatron_prefix(Path(src.source).expanduser())
        assert prefix is not None
        found = _megatron(prefix)
        found["file"] = str(Path(f"{prefix}.bin").resolve())
    else:
        [path] = token_files(src)
        found = _nanogpt(path, src.vocab_size, eos)
        found["file"] = str(path)
    found["vocab_size"] = found["vocab_size"] or src.vocab_size
    return found
