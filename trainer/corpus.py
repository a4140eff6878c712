"""The training corpus: where documents come from and what identifies them.

Sources (`DataConfig.source`): `stdlib` (this Python's standard-library `.py` files, one file per
document, no download), a local file, directory or glob of text, JSONL/JSON or Parquet files,
or `hf:NAME` (optionally `hf:NAME:CONFIG`) for a Hugging Face hub dataset. Local and stdlib
sources never touch the network; Hugging Face's own cache lives under our cache dir.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

if TYPE_CHECKING:
    import datasets

    from pretrain_core.schema import DataConfig

FORMATS_BY_EXTENSION = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""File extension → format, for `format: auto`."""

HF_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}
"""Our format names → Hugging Face `datasets` packaged builders (local files, no download)."""

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def cache_root(data: DataConfig) -> Path:
    """The cache dir with `~` expanded; everything this pipeline writes lives under it."""
    return Path(os.path.expanduser(data.cache_dir))


def stdlib_files() -> list[Path]:
    """This Python's standard-library `.py` files, sorted, without installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.as_posix())


def local_files(data: DataConfig) -> list[Path]:
    """The files a local source names: the file itself, a directory's data files, or a glob."""
    source = os.path.expanduser(data.source)
    if os.path.isdir(source):
        matches = [
            p
            for p in Path(source).rglob("*")
            if p.is_file() and p.suffix in FORMATS_BY_EXTENSION and not p.name.startswith(".")
        ]
    elif os.path.isfile(source):
        matches = [Path(source)]
    else:
        matches = [Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p)]
    if not matches:
        raise FileNotFoundError(
            f"data.source={data.source!r}: no such file, no data files in that directory and "
            f"no glob match; give a file, a directory or a glob of "
            f"{'/'.join(FORMATS_BY_EXTENSION)} files, `stdlib` or `hf:NAME`"
        )
    return sorted((p.resolve() for p in matches), key=lambda p: p.as_posix())


def resolve_format(data: DataConfig) -> str:
    """The source's format: `stdlib`, `hub`, or (for local files) `text`, `jsonl` or `parquet`."""
    if data.source == "stdlib":
        return "stdlib"
    if data.source.startswith("hf:"):
        return "hub"
    if data.format != "auto":
        if data.format not in HF_BUILDERS:
            raise ValueError(
                f"data.format={data.format!r}: unknown; use auto, {', '.join(HF_BUILDERS)}"
            )
        return data.format
    found = {FORMATS_BY_EXTENSION.get(p.suffix) for p in local_files(data)}
    if None in found or len(found) != 1:
        suffixes = sorted({p.suffix or "(none)" for p in local_files(data)})
        raise ValueError(
            f"data.source={data.source!r}: cannot tell the format from extensions {suffixes}; "
            f"use files of one kind ({', '.join(FORMATS_BY_EXTENSION)}) or set data.format"
        )
    return found.pop()


def _file_entries(files: list[Path]) -> list[list[Any]]:
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([path.as_posix(), stat.st_size, stat.st_mtime_ns])
    return entries


def corpus_identity(data: DataConfig) -> dict[str, Any]:
    """What the documents depend on: the file list with sizes and mtimes (or the hub name),
    the format, the text field where it matters, and `max_bytes`. Cheap: stats, no reads."""
    fmt = resolve_format(data)
    identity: dict[str, Any] = {"format": fmt, "max_bytes": data.max_bytes}
    if fmt == "stdlib":
        identity["python"] = sys.version
        identity["files"] = _file_entries(stdlib_files())
    elif fmt == "hub":
        identity["hub"] = data.source[len("hf:") :]
        identity["split"] = data.split
    else:
        identity["files"] = _file_entries(local_files(data))
    if fmt in ("jsonl", "parquet", "hub"):
        identity["text_field"] = data.text_field
    return identity


def identity_hash(identity: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able identity, for cache directory names."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _stdlib_dataset(max_bytes: int) -> datasets.Dataset:
    import datasets

    texts: list[str] = []
    total = 0
    for path in stdlib_files():
        if 0 < max_bytes <= total:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test fixtures are deliberately not UTF-8
        texts.append(text)
        total += len(text.encode("utf-8"))
    return datasets.Dataset.from_dict({"text": texts})


def load_corpus(data: DataConfig) -> datasets.Dataset | datasets.IterableDataset:
    """The corpus as a Hugging Face dataset with the documents in column `text` (stdlib, text)
    or `data.text_field`. Hub datasets stream, so `max_bytes` bounds what is downloaded."""
    import datasets

    datasets.disable_progress_bars()  # the builder prints its own one-line summary
    fmt = resolve_format(data)
    hf_cache = str(cache_root(data) / "huggingface")
    if fmt == "stdlib":
        dataset = _stdlib_dataset(data.max_bytes)
    elif fmt == "hub":
        name, _, config = data.source[len("hf:") :].partition(":")
        dataset = datasets.load_dataset(
            name, config or None, split=data.split, streaming=True, cache_dir=hf_cache
        )
    else:
        files = [p.as_posix() for p in local_files(data)]
        extra = {"sample_by": "document"} if fmt == "text" else {}
        dataset = datasets.load_dataset(
            HF_BUILDERS[fmt], data_files=files, split="train", cache_dir=hf_cache, **extra
        )
    field = text_column(data)
    if dataset.column_names is not None and field not in dataset.column_names:
        raise ValueError(
            f"data.text_field={data.text_field!r}: no such column in {data.source!r}; "
            f"columns are {dataset.column_names}"
        )
    return dataset


def text_column(data: DataConfig) -> str:
    """The column that holds the document text for this source."""
    return "text" if resolve_format(data) in ("stdlib", "text") else data.text_field


def iter_document_batches(data: DataConfig, batch_size: int = 512) -> Iterator[list[str]]:
    """The corpus's documents in order, in lists of up to `batch_size`, cut at `max_bytes`
    bytes of UTF-8 when that is > 0 (the last document is truncated to fit)."""
    dataset = load_corpus(data)
    field = text_column(data)
    budget = data.max_bytes if data.max_bytes > 0 else None
    for rows in dataset.select_columns([field]).iter(batch_size=batch_size):
        batch = []
        for text in rows[field]:
            if text is None:
                continue
            if budget is not None:
                size = len(text.encode("utf-8"))
                if size >= budget:
                    # errors="ignore" drops a character cut in half at the byte limit
                    text = text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
                    size = budget
                budget -= size
            batch.append(text)
            if budget == 0:
                break
        if batch:
            yield batch
        if budget == 0:
            return


def build_once(done: Path, build: Callable[[], None]) -> None:
    """Run `build` unless `done` exists. Concurrent callers (ranks starting together, on any
    node sharing the cache) wait on a file lock beside `done` while the first one builds;
    `build` must create `done` last and atomically, so a reader never sees half a cache."""
    if done.exists():
        return
    done.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(done.parent / "build.lock")):
        if not done.exists():
            build()
