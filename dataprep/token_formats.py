"""The headers of pre-tokenized formats, read with the standard library only.

- nanoGPT: a flat file of uint16 token ids (`train.bin`), optionally a `meta.pkl` beside it
  with the vocabulary (`vocab_size`, char-level `itos`/`stoi`). The pickle is read with an
  unpickler that refuses every global, so a hostile file cannot run code.
- Megatron-LM indexed dataset (`PREFIX.idx` + `PREFIX.bin`), as its `_IndexWriter` writes
  it: the 9-byte magic `MMIDIDX\\x00\\x00`, version <Q (1), dtype code <B, sequence count <Q,
  document-index count <Q; then int32 sequence lengths, int64 byte pointers into the .bin,
  and int64 document indices (the first sequence of each document, and a final sentinel).
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, read_bytes, read_span

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
"""Megatron's DType codes -> numpy dtype names."""
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64", "uint32")
"""Integer dtypes token ids may be stored in."""
DTYPE_SIZES = {"uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4}
DTYPE_SIZES.update(int64=8, float32=4, float64=8)


MAX_META_BYTES = 64 << 20
"""Bound of a nanoGPT meta.pkl read (its itos/stoi of a character vocabulary: kilobytes)."""


class FormatError(ValueError):
    """A pre-tokenized file that does not hold what its format says; names the file."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: plain data only")


def read_nanogpt_meta(path: Path) -> dict[str, Any]:
    """nanoGPT's meta.pkl: a dict of plain data (vocab_size, itos, stoi)."""
    try:
        raw = read_bytes(path, "nanoGPT's meta.pkl", MAX_META_BYTES)
    except ReadError as err:
        raise FormatError(str(err)) from None
    try:
        meta = _NoGlobals(io.BytesIO(raw)).load()
    except Exception as exc:
        raise FormatError(f"{path}: not a plain-data pickle ({exc})") from None
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: holds a {type(meta).__name__}, not a dict with vocab_size")
    return meta


def nanogpt_vocab(bin_path: Path, given: int) -> int:
    """The vocabulary of a nanoGPT token file: `given`, else meta.pkl's `vocab_size`, else 0
    (unknown)."""
    if given:
        return given
    meta_path = bin_path.parent / "meta.pkl"
    if not meta_path.is_file():
        return 0
    vocab = read_nanogpt_meta(meta_path).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise FormatError(f"{meta_path}: vocab_size is {vocab!r}, not a positive integer")
    return vocab


@dataclass(frozen=True)
class MegatronHeader:
    """What a Megatron .idx file says before its arrays."""

    dtype: str
    sequences: int
    document_indices: int
    arrays_offset: int
    """Byte offset of the sequence lengths in the .idx file."""

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


def read_megatron_header(idx_path: Path) -> MegatronHeader:
    """Parse and check the header of a Megatron .idx file."""
    try:
        head = read_span(idx_path, "a Megatron .idx file", 0, len(MEGATRON_MAGIC) + 25)
    except ReadError as err:
        raise FormatError(str(err)) from None
    size = idx_path.stat().st_size
    if len(head) < len(MEGATRON_MAGIC) + 25 or not head.startswith(MEGATRON_MAGIC):
        raise FormatError(f"{idx_path}: not a Megatron index (no MMIDIDX header)")
    offset = len(MEGATRON_MAGIC)
    version, code, sequences, documents = struct.unpack_from("<QBQQ", head, offset)
    if version != MEGATRON_VERSION:
        raise FormatError(f"{idx_path}: index version {version}; only {MEGATRON_VERSION} is known")
    dtype = MEGATRON_DTYPES.get(code)
    if dtype is None or dtype not in TOKEN_DTYPES:
        raise FormatError(f"{idx_path}: dtype code {code} is not an integer token dtype")
    arrays = offset + 25
    needed = arrays + sequences * (4 + 8) + documents * 8
    if size < needed or documents < 1:
        raise FormatError(
            f"{idx_path}: {size} bytes, but {sequences} sequences and {documents} document "
            f"indices need {needed}"
        )
    return MegatronHeader(dtype, sequences, documents, arrays)
