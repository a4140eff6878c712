"""Documents of a text source, in a fixed order, cut into work units for parallel workers.

A unit is a piece one worker reads and tokenizes on its own: a group of consecutive files
(a file is one unit or part of one), a range of a large Parquet file's row groups, a range
of rows of a `save_to_disk` dataset, or one shard of a hub dataset. The documents of the
units in order are the source's documents in order, however many workers there are. Unit
sizes depend only on the source and its limits (`unit_bytes`), so a stopped preparation
resumes with the same units.

Formats: a text file is one document; JSONL holds one JSON object per line (its
`text_field` is the document, a null one is skipped); Parquet and Hugging Face datasets are
read column `text_field`. Compressed files (.gz, .zst, .bz2, .xz) are read transparently.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, read_text
from pretrain.core.schema import SourceConfig
from pretrain.dataprep.checks import open_decompressed
from pretrain.dataprep.sources import (
    local_files,
    resolve_format,
    stdlib_files,
    text_format,
)

MAX_STDLIB_BYTES = 16 << 20
"""Bound of a standard-library source read whole (the largest, pydoc topics, is under 1 MiB)."""
BATCH_DOCS = 256
"""Documents handed to the tokenizer at once."""
MIN_UNIT_BYTES = 16 << 10
MAX_UNIT_BYTES = 64 << 20
TARGET_UNITS = 64
"""A source is cut into about this many units (within the bounds above), so that its first
units spread over the workers and a cut at max_bytes/max_tokens wastes little."""
BYTES_PER_TOKEN = 4
"""A rough size of a token in text, to size units when max_tokens bounds the source."""


@dataclass(frozen=True)
class Unit:
    """One piece of a source that one worker reads: files, row groups, rows or a hub shard."""

    index: int
    files: tuple[str, ...] = ()
    row_groups: tuple[int, int] | None = None
    """Of a Parquet file (the unit's one file): row groups [first, last)."""
    rows: tuple[int, int] | None = None
    """Of a save_to_disk dataset: rows [first, last)."""
    shard: tuple[int, int] | None = None
    """Of a hub dataset: (index, number of shards)."""
    input_bytes: int = 0
    """Bytes of input it reads (0 when unknown), for progress and ETA."""

    def spec(self) -> dict[str, Any]:
        """A JSON-able description, kept in the unit's done marker to check a resume."""
        return json.loads(json.dumps(asdict(self)))  # type: ignore[no-any-return]


def unit_bytes(src: SourceConfig, total_bytes: int) -> int:
    """Input bytes per unit: a TARGET_UNITS-th of what will be read, within the bounds."""
    budget = total_bytes
    if src.max_bytes > 0:
        budget = min(budget, src.max_bytes)
    if src.max_tokens > 0:
        budget = min(budget, src.max_tokens * BYTES_PER_TOKEN)
    return max(MIN_UNIT_BYTES, min(MAX_UNIT_BYTES, budget // TARGET_UNITS))


def plan_units(src: SourceConfig) -> list[Unit]:
    """The source's units, in document order."""
    kind = resolve_format(src)
    if kind == "hub":
        return _hub_units(src)
    if kind == "hf_disk":
        return _hf_disk_units(src)
    files = stdlib_files() if kind == "stdlib" else local_files(src)
    sizes = [p.stat().st_size for p in files]
    target = unit_bytes(src, sum(sizes))
    units: list[Unit] = []
    group: list[str] = []
    group_bytes = 0

    def close_group() -> None:
        nonlocal group, group_bytes
        if group:
            units.append(Unit(len(units), tuple(group), input_bytes=group_bytes))
        group, group_bytes = [], 0

    for path, size in zip(files, sizes, strict=True):
        if size > target and text_format(path, src.format) == "parquet":
            close_group()
            for first, last, nbytes in _row_group_ranges(path, target):
                units.append(Unit(len(units), (str(path),), (first, last), input_bytes=nbytes))
            continue
        if group and group_bytes + size > target:
            close_group()
        group.append(str(path))
        group_bytes += size
    close_group()
    return units


def _row_group_ranges(path: Path, target: int) -> list[tuple[int, int, int]]:
    """Consecutive row-group ranges of a Parquet file of about `target` bytes each."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    ranges, first, nbytes = [], 0, 0
    for i in range(meta.num_row_groups):
        nbytes += meta.row_group(i).total_byte_size
        if nbytes >= target:
            ranges.append((first, i + 1, nbytes))
            first, nbytes = i + 1, 0
    if first < meta.num_row_groups:
        ranges.append((first, meta.num_row_groups, nbytes))
    return ranges


def _load_hf_disk(src: SourceConfig) -> Any:
    import datasets

    datasets.disable_progress_bars()
    loaded = datasets.load_from_disk(os.path.expanduser(src.source))
    return loaded[src.split] if isinstance(loaded, datasets.DatasetDict) else loaded


def _hf_disk_units(src: SourceConfig) -> list[Unit]:
    dataset = _load_hf_disk(src)
    total = sum(f.stat().st_size for f in Path(os.path.expanduser(src.source)).rglob("*.arrow"))
    n_units = max(1, -(-total // unit_bytes(src, total)))
    rows = len(dataset)
    bounds = [rows * i // n_units for i in range(n_units + 1)]
    return [
        Unit(i, rows=(a, b), input_bytes=total * (b - a) // max(rows, 1))
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
        if b > a
    ]


def _hub_dataset(src: SourceConfig) -> Any:
    import datasets

    datasets.disable_progress_bars()
    name, _, config = src.source[len("hf:") :].partition(":")
    return datasets.load_dataset(name, config or None, split=src.split, streaming=True)


def _hub_units(src: SourceConfig) -> list[Unit]:
    dataset = _hub_dataset(src)
    shards = int(getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", 1) or 1)
    return [Unit(i, shard=(i, shards)) for i in range(shards)]


def unit_documents(src: SourceConfig, unit: Unit) -> Iterator[list[str]]:
    """The unit's documents in order, in lists of up to BATCH_DOCS."""
    kind = resolve_format(src)
    if kind == "hf_disk":
        yield from _hf_disk_documents(src, unit)
        return
    if kind == "hub":
        yield from _hub_documents(src, unit)
        return
    batch: list[str] = []
    for name in unit.files:
        for text in _file_documents(Path(name), src, kind, unit.row_groups):
            batch.append(text)
            if len(batch) == BATCH_DOCS:
                yield batch
                batch = []
    if batch:
        yield batch


def _file_documents(
    path: Path, src: SourceConfig, kind: str, row_groups: tuple[int, int] | None
) -> Iterator[str]:
    if kind == "stdlib":
        try:
            text = read_text(path, "a standard-library source", MAX_STDLIB_BYTES)
        except ReadError:
            return  # a few test fixtures are deliberately not UTF-8
        yield text
        return
    fmt = text_format(path, src.format)
    if fmt == "parquet":
        yield from _parquet_documents(path, src.text_field, row_groups)
        return
    with open_decompressed(path) as raw:
        stream = io.TextIOWrapper(raw, encoding="utf-8", newline="" if fmt == "text" else None)
        try:
            if fmt == "text":
                yield stream.read()
                return
            yield from _jsonl_documents(path, stream, src.text_field)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc})") from None


def _jsonl_documents(path: Path, lines: io.TextIOWrapper, field: str) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict) or field not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{path}:{number}: no field {field!r} (data.text_field); it has {fields}"
            )
        text = record[field]
        if text is not None:
            yield str(text)


def _parquet_documents(path: Path, field: str, row_groups: tuple[int, int] | None) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {field!r} (data.text_field); it has {parquet.schema_arrow.names}"
        )
    groups = list(range(*row_groups)) if row_groups else None
    for batch in parquet.iter_batches(columns=[field], row_groups=groups, batch_size=BATCH_DOCS):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def _hf_disk_documents(src: SourceConfig, unit: Unit) -> Iterator[list[str]]:
    dataset = _load_hf_disk(src)
    if src.text_field not in dataset.column_names:
        raise ValueError(
            f"data.text_field={src.text_field!r}: no such column in {src.source}; the columns "
            f"are {dataset.column_names}"
        )
    first, last = unit.rows or (0, len(dataset))
    for start in range(first, last, BATCH_DOCS):
        texts = dataset[start : min(start + BATCH_DOCS, last)][src.text_field]
        yield [str(t) for t in texts if t is not None]


def _hub_documents(src: SourceConfig, unit: Unit) -> Iterator[list[str]]:
    assert unit.shard is not None
    index, shards = unit.shard
    dataset = _hub_dataset(src).shard(num_shards=shards, index=index)
    batch: list[str] = []
    for row in dataset:
        text = row.get(src.text_field)
        if text is None:
            continue
        batch.append(str(text))
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def source_documents(src: SourceConfig) -> Iterator[list[str]]:
    """All the source's documents in order (one process), up to max_bytes of text with the
    document that reaches it kept whole: what a tokenizer is trained on."""
    seen = 0
    for unit in plan_units(src):
        for batch in unit_documents(src, unit):
            kept = []
            for text in batch:
                kept.append(text)
                seen += len(text.encode("utf-8"))
                if 0 < src.max_bytes <= seen:
                    yield kept
                    return
            yield kept
