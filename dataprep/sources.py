"""What a data source is: its kind, its files, its identity, and where it is prepared.

Shared by the launcher (validation on the login node, the check that a SLURM run's data is
prepared) and the trainer (preparation, the ranks), so both name the same files and compute
the same dataset directory. Standard library only: no torch, no `datasets`.

Kinds (`resolve_format`): `stdlib`; `hub` (`hf:NAME[:CONFIG]`); `files` (text, JSONL or
Parquet files, each read by its own extension, compressed ones included); `hf_disk` (a
`save_to_disk` directory); `nanogpt` (a flat `.bin` of token ids); `megatron` (PREFIX.bin +
PREFIX.idx); `prepared` (a directory this project prepared, named by its manifest).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pretrain.core.inputs import reading
from pretrain.core.schema import DataConfig, SourceConfig
from pretrain.dataprep.dataset_manifest import MANIFEST as MANIFEST  # where callers look for it

DATASET_VERSION = 1
"""Bump when the prepared layout or the content rules change, so datasets are prepared anew."""
TOKENIZER_TRAINER_VERSION = 1
"""Bump when the byte-level BPE training recipe changes, so cached tokenizers are retrained."""

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer a prepared dataset was made with, copied beside its manifest."""
DATASETS_DIR = "datasets"
TOKENIZERS_DIR = "tokenizers"

TEXT_EXTENSIONS = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""File extension -> how its documents are read (a text file is one document)."""
COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
"""Compression suffixes read transparently after a text extension (`a.jsonl.zst`)."""
TOKEN_FORMATS = ("nanogpt", "megatron")
"""Sources whose files already hold token ids."""
HF_DISK_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files that mark a Hugging Face `save_to_disk` directory (a Dataset or a DatasetDict)."""

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def cache_root(data: DataConfig) -> Path:
    """The cache dir with `~` expanded; everything preparation writes lives under it."""
    return Path(os.path.expanduser(data.cache_dir))


def resolved_sources(data: DataConfig) -> list[SourceConfig]:
    """The training sources: `data.sources`, or the one `data.source` with data's fields."""
    if data.sources:
        return list(data.sources)
    return [single_source(data, data.source)]


def single_source(data: DataConfig, source: str) -> SourceConfig:
    """`source` read with data's per-source fields (format, text field, split, limits)."""
    shared = {f.name: getattr(data, f.name) for f in fields(SourceConfig) if hasattr(data, f.name)}
    return SourceConfig(**{**shared, "source": source, "weight": 1.0, "name": ""})


def source_label(src: SourceConfig, index: int) -> str:
    """A short metric-safe name: `name`, else the source's last path part or hub name."""
    raw = src.name or Path(src.source.rstrip("/").split(":")[-1]).stem or f"source{index}"
    return re.sub(r"[^A-Za-z0-9_]+", "_", raw).strip("_").lower() or f"source{index}"


def stdlib_files() -> list[Path]:
    """This Python's standard-library `.py` files, sorted, without installed packages."""
    return list(_stdlib_files())


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    # Walked once per process: the standard library does not change under a running
    # Python, and validation asks for it several times per recipe (the corpus and the
    # trained tokenizer's identities), and tools validate many recipes.
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return tuple(sorted(files, key=lambda p: p.as_posix()))


def text_format(path: Path, forced: str = "auto") -> str | None:
    """How a file's documents are read (text, jsonl, parquet), None for a file that is not
    data (a README beside the shards); `forced` (data.format) overrides the extension."""
    if forced in TEXT_EXTENSIONS.values():
        return forced
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return TEXT_EXTENSIONS.get(suffixes[-1]) if suffixes else None


def compression(path: Path) -> str | None:
    """The compression suffix of a file, if it has one."""
    return path.suffix if path.suffix in COMPRESSIONS else None


class SourceError(ValueError):
    """A source that cannot be read as given; the message names it and what would fit."""


def resolve_format(src: SourceConfig) -> str:
    """The source's kind: stdlib, hub, files, hf_disk, nanogpt, megatron or prepared."""
    if src.source == "stdlib":
        return "stdlib"
    if src.source.startswith("hf:"):
        return "hub"
    forced = src.format
    if forced in ("hf_disk", "nanogpt", "megatron", "prepared"):
        return forced
    path = Path(os.path.expanduser(src.source))
    if path.is_dir() and forced == "auto":
        if (path / MANIFEST).is_file():
            return "prepared"
        if any((path / name).is_file() for name in HF_DISK_FILES):
            return "hf_disk"
    if forced == "auto" and megatron_prefix(path) is not None:
        return "megatron"
    if forced == "auto" and path.suffix == ".bin" and path.is_file():
        return "nanogpt"
    return "files"


def megatron_prefix(path: Path) -> Path | None:
    """PREFIX when `path` is PREFIX, PREFIX.bin or PREFIX.idx and both files exist."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    return prefix if bin_file.is_file() and idx_file.is_file() else None


def local_files(src: SourceConfig) -> list[Path]:
    """The data files a `files` source names: the file, a directory's data files (nested,
    compressed included, hidden files and non-data files left out), or a glob's matches."""
    source = os.path.expanduser(src.source)
    if os.path.isfile(source):
        return [Path(source).resolve()]  # named on its own: checked, never skipped
    if os.path.isdir(source):
        visible = [
            p
            for p in Path(source).rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
        ]
        matches = [p for p in visible if text_format(p, src.format) is not None]
        if not matches:
            raise SourceError(_no_data_files(source, visible))
    else:
        matches = [Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p)]
        if not matches:
            raise SourceError(f"{source}: no such file or directory, and no glob match")
    # An empty file among many holds no document: it is left out, not a reason to refuse.
    found = [p for p in matches if p.stat().st_size > 0]
    if not found:
        raise SourceError(f"{source}: all {len(matches)} of its data files are empty")
    return sorted((p.resolve() for p in found), key=lambda p: p.as_posix())


def _no_data_files(source: str, visible: list[Path]) -> str:
    """Why a directory gives no data files, and how to read the files it does hold."""
    why = (
        f"{source} holds no data files ({', '.join(TEXT_EXTENSIONS)}, optionally "
        f"{'/'.join(COMPRESSIONS)} compressed)"
    )
    suffixes = sorted({p.suffix for p in visible if p.suffix})
    if not visible:
        return why
    example = f"{source.rstrip('/')}/**/*{suffixes[0]}" if suffixes else f"{source}/**/*"
    return (
        f"{why}; its {len(visible)} other files ({', '.join(suffixes[:5]) or 'no extension'}) "
        f"are read as text with data.format=text, or name them with a glob such as '{example}'"
    )


def token_files(src: SourceConfig) -> list[Path]:
    """The files of a pre-tokenized source: the .bin (and .idx of a Megatron dataset)."""
    path = Path(os.path.expanduser(src.source))
    if resolve_format(src) == "megatron":
        prefix = megatron_prefix(path) or path
        return [Path(f"{prefix}.bin").resolve(), Path(f"{prefix}.idx").resolve()]
    return [path.resolve()]


def _file_entries(files: list[Path]) -> list[list[Any]]:
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([path.as_posix(), stat.st_size, stat.st_mtime_ns])
    return entries


@functools.cache
def _stdlib_entries() -> tuple[tuple[str, int, int], ...]:
    """The standard library's files with their sizes and mtimes, stat'ed once per process."""
    return tuple((path, size, mtime) for path, size, mtime in _file_entries(list(_stdlib_files())))


def source_files(src: SourceConfig) -> list[Path]:
    """Every local file a source reads (empty for the hub)."""
    kind = resolve_format(src)
    if kind == "stdlib":
        return stdlib_files()
    if kind == "files":
        return local_files(src)
    if kind in TOKEN_FORMATS:
        return token_files(src)
    if kind in ("hf_disk", "prepared"):
        root = Path(os.path.expanduser(src.source)).resolve()
        return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    return []


def source_identity(src: SourceConfig) -> dict[str, Any]:
    """What the documents depend on: the files with sizes and mtimes (or the hub name), how
    they are read, and the limits. Cheap: stats, no reads."""
    kind = resolve_format(src)
    identity: dict[str, Any] = {
        "kind": kind,
        "max_bytes": src.max_bytes,
        "max_tokens": src.max_tokens,
    }
    if kind == "hub":
        identity.update(hub=src.source[len("hf:") :], split=src.split)
    elif kind == "stdlib":
        identity["files"] = [list(entry) for entry in _stdlib_entries()]
    else:
        identity["files"] = _file_entries(source_files(src))
    if kind == "stdlib":
        identity["python"] = sys.version
    if kind in ("files", "hub", "hf_disk"):
        identity.update(text_field=src.text_field, format=src.format)
    if kind == "hf_disk":
        identity["split"] = src.split
    if kind in TOKEN_FORMATS:
        identity["vocab_size"] = src.vocab_size
    return identity


def identity_hash(identity: Any) -> str:
    """A short stable hash of a JSON-able identity, for cache directory names."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    """Hex digest of a tokenizer file's bytes (ReadError for what is not a regular file)."""
    return reading.file_sha256(path, "a tokenizer file")


def text_sources(data: DataConfig) -> list[SourceConfig]:
    """The sources whose text a trained tokenizer learns from (training, then validation)."""
    every = resolved_sources(data)
    if data.val_source:
        every.append(single_source(data, data.val_source))
    return [s for s in every if resolve_format(s) not in (*TOKEN_FORMATS, "prepared")]


def tokenizer_file(data: DataConfig) -> Path | None:
    """The tokenizer.json `data.tokenizer` names (None for `train` and `none`)."""
    if data.tokenizer in ("train", "none"):
        return None
    path = Path(os.path.expanduser(data.tokenizer))
    return path / TOKENIZER_FILE if path.is_dir() else path


def trained_tokenizer_spec(data: DataConfig, vocab_size: int) -> dict[str, Any]:
    """What a trained tokenizer depends on: the text it learns from, its size, the recipe."""
    return {
        "corpus": [source_identity(s) for s in text_sources(data)],
        "vocab_size": vocab_size,
        "version": TOKENIZER_TRAINER_VERSION,
    }


def trained_tokenizer_path(data: DataConfig, vocab_size: int) -> Path:
    """Where the tokenizer `data.tokenizer=train` trains is cached."""
    key = identity_hash(trained_tokenizer_spec(data, vocab_size))
    return cache_root(data) / TOKENIZERS_DIR / key / TOKENIZER_FILE


def tokenizer_spec(data: DataConfig, vocab_size: int) -> dict[str, Any] | None:
    """The tokenizer's identity without loading it: a trained one's inputs, or the digest of
    a tokenizer file and of the tokenizer_config.json beside it; None for `none`."""
    if data.tokenizer == "none":
        return None
    path = tokenizer_file(data)
    if path is None:
        return {"train": trained_tokenizer_spec(data, vocab_size)}
    config = path.parent / "tokenizer_config.json"
    return {
        "file_sha256": file_sha256(path),
        "config_sha256": file_sha256(config) if config.is_file() else None,
    }


@dataclass(frozen=True)
class DatasetPlace:
    """Where one source is (or will be) prepared, and the key it is prepared under."""

    source: SourceConfig
    kind: str
    folder: Path
    key: str


def dataset_place(data: DataConfig, src: SourceConfig, vocab_size: int) -> DatasetPlace:
    """The prepared dataset directory of `src` under `data`'s tokenizer: the source itself
    when it is a prepared dataset, else cache_dir/datasets/KEY."""
    kind = resolve_format(src)
    if kind == "prepared":
        folder = Path(os.path.expanduser(src.source)).resolve()
        return DatasetPlace(src, kind, folder, folder.name)
    key = identity_hash(
        {
            "source": source_identity(src),
            "tokenizer": tokenizer_spec(data, vocab_size),
            "version": DATASET_VERSION,
        }
    )
    return DatasetPlace(src, kind, cache_root(data) / DATASETS_DIR / key, key)


def dataset_places(data: DataConfig, vocab_size: int) -> list[DatasetPlace]:
    """Every dataset a run reads: its training sources, then `data.val_source` if set."""
    places = [dataset_place(data, s, vocab_size) for s in resolved_sources(data)]
    if data.val_source:
        places.append(dataset_place(data, single_source(data, data.val_source), vocab_size))
    return places
