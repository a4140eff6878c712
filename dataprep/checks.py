"""Checks that read the data a recipe names: files, tokenizer, cache dir, prepared datasets.

They look at the disk (stats and a few KB of each file, never whole files), so the launcher
runs them where it can see the data (a local launch, a local prepare) and the trainer runs
the same ones when a SLURM job starts preparing. Each problem names the field, the file,
what is wrong and what would fit.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

from pretrain.core.inputs.reading import (
    ReadError,
    mapping,
    open_binary,
    read_mapping,
    read_span,
)
from pretrain.core.problems import Checks, install_fix, installed
from pretrain.core.schema import RecipeConfig, SourceConfig
from pretrain.dataprep.dataset_manifest import read_manifest
from pretrain.dataprep.sources import (
    DatasetPlace,
    SourceError,
    cache_root,
    compression,
    dataset_places,
    file_sha256,
    local_files,
    megatron_prefix,
    resolve_format,
    single_source,
    text_format,
    tokenizer_file,
)
from pretrain.dataprep.token_formats import (
    DTYPE_SIZES,
    FormatError,
    nanogpt_vocab,
    read_megatron_header,
)

SNIFF_BYTES = 4096
"""Bytes of each file looked at to tell text from binary."""
MAX_TOKENIZER_BYTES = 256 << 20
"""Bound of a tokenizer.json read (a 256k-token vocabulary with its merges is about 30 MiB)."""
FIRST_LINE_LIMIT = 1 << 20
"""A JSONL file's first record is checked for the text field if it ends within this."""


def source_fields(cfg: RecipeConfig) -> Iterator[tuple[str, SourceConfig]]:
    """(field path, source) of every source the recipe reads, validation included."""
    d = cfg.data
    if d.sources:
        for i, src in enumerate(d.sources):
            yield f"data.sources[{i}].source", src
    else:
        yield "data.source", single_source(d, d.source)
    if d.val_source:
        yield "data.val_source", single_source(d, d.val_source)


_DECOMPRESSORS: dict[str, Callable[[BinaryIO], BinaryIO]] = {
    ".gz": lambda raw: cast(BinaryIO, gzip.GzipFile(fileobj=raw, mode="rb")),
    ".bz2": lambda raw: cast(BinaryIO, bz2.BZ2File(raw, "rb")),
    ".xz": lambda raw: cast(BinaryIO, lzma.LZMAFile(raw, "rb")),  # noqa: SIM115 (closed by the caller)
}
"""Compression suffix -> a decompressing reader over an open file (which it leaves open)."""


@contextmanager
def open_decompressed(path: Path) -> Iterator[BinaryIO]:
    """A binary stream of a regular file's contents, decompressed by its suffix (the file
    and the decompressor both closed on leaving); ReadError for a FIFO or a device."""
    kind = compression(path)
    with open_binary(path, "a data file") as raw:
        if kind == ".zst":
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                yield cast(BinaryIO, stream)
            return
        opener = _DECOMPRESSORS.get(kind or "")
        if opener is None:
            yield raw
            return
        with opener(raw) as stream:
            yield stream


def _decodes_as_text(head: bytes, complete: bool) -> bool:
    if b"\x00" in head:
        return False
    # A prefix may end inside a multi-byte character: allow up to 3 bytes cut off.
    for cut in range(1 if complete else 4):
        try:
            head[: len(head) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def file_problem(path: Path, fmt: str, text_field: str) -> str | None:
    """Why `path` cannot be read as `fmt` (empty, binary, not Parquet, no text field), or
    None when its first bytes look right."""
    if path.stat().st_size == 0:
        return f"{path} is empty"
    if fmt == "parquet":
        try:
            magic = read_span(path, "a Parquet file", 0, 4)
        except ReadError as err:
            return str(err)
        return None if magic == b"PAR1" else f"{path} is not a Parquet file (no PAR1 magic)"
    try:
        with open_decompressed(path) as stream:
            head = stream.read(SNIFF_BYTES)
            if fmt == "jsonl" and b"\n" not in head:
                head += stream.readline(FIRST_LINE_LIMIT)
    except ReadError as err:
        return str(err)
    except ImportError:
        return f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
    except (OSError, EOFError, lzma.LZMAError) as exc:
        return f"{path} cannot be decompressed ({exc})"
    if not head:
        return f"{path} is empty once decompressed"
    if not _decodes_as_text(head, complete=len(head) < SNIFF_BYTES):
        return f"{path} is binary, not UTF-8 text"
    if fmt == "jsonl":
        return _first_record_problem(path, head, text_field)
    return None


def _first_record_problem(path: Path, head: bytes, text_field: str) -> str | None:
    line = head.split(b"\n", 1)[0].strip()
    if not line or (b"\n" not in head and len(head) >= SNIFF_BYTES + FIRST_LINE_LIMIT):
        return None  # a first record too long to check here: the reader will
    try:
        record = json.loads(line)
    except ValueError:
        return f"{path}:1 is not a JSON object"
    if not isinstance(record, dict):
        return f"{path}:1 is a JSON {type(record).__name__}, not an object"
    if text_field not in record:
        return f"{path}:1 has no field {text_field!r}; its fields are {sorted(record)}"
    return None


def tokenizer_max_id(path: Path) -> int:
    """The largest id a tokenizer.json can produce (its model's vocabulary and added tokens)."""
    expected = "a Hugging Face tokenizer.json"
    spec = read_mapping(path, expected, MAX_TOKENIZER_BYTES)
    ids: list[int] = []
    vocab = mapping(spec.get("model"), path, f"{expected} whose model is a mapping").get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if type(v) is int]
    elif isinstance(vocab, list):  # Unigram: a list of [piece, score]
        ids.append(len(vocab) - 1)
    added = spec.get("added_tokens")
    for token in added if isinstance(added, list) else []:
        if isinstance(token, dict) and type(token.get("id")) is int:
            ids.append(token["id"])
    if not ids:
        raise ValueError(f"{path}: no vocabulary in this tokenizer.json")
    return max(ids)


def check_tokenizer(c: Checks, cfg: RecipeConfig) -> None:
    """The tokenizer exists, parses, and its ids fit model.vocab_size; `none` only when every
    source is pre-tokenized."""
    d = cfg.data
    kinds = {f: _kind(src) for f, src in source_fields(cfg)}
    text = [f for f, k in kinds.items() if k not in (None, "nanogpt", "megatron", "prepared")]
    tokens = [f for f, k in kinds.items() if k in ("nanogpt", "megatron")]
    if d.tokenizer == "none" and text:
        c.add(
            "data.tokenizer",
            d.tokenizer,
            f"{text[0]} is text and needs a tokenizer",
            "give a tokenizer.json or directory, or `train`",
        )
    if d.tokenizer == "train" and tokens:
        c.add(
            "data.tokenizer",
            d.tokenizer,
            f"{tokens[0]} holds token ids from an existing tokenizer; a BPE trained here "
            "would not match them",
            "give that tokenizer (a tokenizer.json or directory), or `none`",
        )
    path = tokenizer_file(d)
    if path is None:
        return
    if not path.is_file():
        c.add(
            "data.tokenizer",
            d.tokenizer,
            "no such tokenizer.json or tokenizer directory",
            "give a tokenizer.json path or a Hugging Face tokenizer directory, `train` or `none`",
        )
        return
    try:
        top = tokenizer_max_id(path)
    except (ValueError, AttributeError, TypeError) as exc:
        c.add(
            "data.tokenizer",
            d.tokenizer,
            f"{path} is not a tokenizer.json ({exc})",
            "give a tokenizer saved by the tokenizers library or transformers",
        )
        return
    if top >= cfg.model.vocab_size:
        c.add(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"smaller than the tokenizer's ids (up to {top} in {path})",
            f"set model.vocab_size to at least {top + 1}",
        )


def _kind(src: SourceConfig) -> str | None:
    try:
        return resolve_format(src)
    except OSError:
        return None


def check_source(c: Checks, field: str, src: SourceConfig, cfg: RecipeConfig) -> None:
    """One source exists and its files look like what it claims to be."""
    if src.source.startswith("hf:"):
        _needs(c, field, src, "datasets", "a hub dataset")
        return
    if src.source in ("stdlib",):
        return
    fix = "give a file, directory or glob of text/JSONL/Parquet, stdlib, hf:NAME or a token file"
    if not src.source.strip():
        c.add(field, src.source, "is empty", fix)
        return
    kind = resolve_format(src)
    if kind == "files":
        try:
            files = local_files(src)
        except SourceError as exc:
            c.add(field, src.source, str(exc), fix)
            return
        if any(text_format(path, src.format) == "parquet" for path in files):
            _needs(c, field, src, "pyarrow", "Parquet files")
        for path in files:
            problem = file_problem(path, text_format(path, src.format) or "text", src.text_field)
            if problem:
                c.add(field, src.source, problem, "remove or replace that file, or name others")
    elif kind == "nanogpt":
        _check_nanogpt(c, field, src, cfg)
    elif kind == "megatron":
        _check_megatron(c, field, src)
    elif kind == "hf_disk":
        _needs(c, field, src, "datasets", "a save_to_disk folder")
        _check_hf_disk(c, field, src)
    elif kind == "prepared":
        _check_prepared_folder(c, field, src)


def _needs(c: Checks, field: str, src: SourceConfig, module: str, what: str) -> None:
    """Refuse a source whose reader is an optional package that is not installed."""
    if not installed(module):
        c.add(field, src.source, f"reading {what} needs the {module} package", install_fix(module))


def _check_nanogpt(c: Checks, field: str, src: SourceConfig, cfg: RecipeConfig) -> None:
    path = Path(os.path.expanduser(src.source))
    size = path.stat().st_size
    if size == 0 or size % 2:
        c.add(
            field,
            src.source,
            f"{path} has {size} bytes, not a whole number of uint16 ids",
            "give a nanoGPT .bin of uint16 token ids",
        )
        return
    try:
        vocab = nanogpt_vocab(path, src.vocab_size)
    except FormatError as exc:
        c.add(field, src.source, str(exc), "give a meta.pkl with vocab_size, or data.vocab_size")
        return
    if vocab > cfg.model.vocab_size:
        c.add(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"smaller than the vocabulary of {path} ({vocab})",
            f"set model.vocab_size to at least {vocab}",
        )
    _check_token_range_split(c, field, path, size // 2, cfg)


def _check_token_range_split(
    c: Checks, field: str, path: Path, tokens: int, cfg: RecipeConfig
) -> None:
    """A flat token file read without a tokenizer is one document, split by token range:
    its held-out tail must hold at least one validation sequence."""
    d, need = cfg.data, cfg.train.seq_len + 1
    if field == "data.val_source" or d.tokenizer != "none" or cfg.eval.every <= 0:
        return
    held = int(d.val_fraction * tokens) if 0 < d.val_fraction < 1 else 0
    if 0 < d.val_fraction < 1 and held < need:
        enough = min(0.5, need / tokens)
        c.add(
            "data.val_fraction",
            d.val_fraction,
            f"holds out the last {held:,} of the {tokens:,} tokens of {path} (a flat file "
            f"without end-of-sequence tokens is split by token range), fewer than one "
            f"validation sequence of {need} tokens",
            f"raise it to at least {enough:.3g}, put a val.bin beside it, or eval.every=0",
        )


def _check_megatron(c: Checks, field: str, src: SourceConfig) -> None:
    prefix = megatron_prefix(Path(os.path.expanduser(src.source)))
    if prefix is None:  # data.format=megatron given for what is not a PREFIX of two files
        c.add(field, src.source, "no PREFIX.bin and PREFIX.idx regular files there",
              "give a Megatron-LM PREFIX whose .bin and .idx exist")  # fmt: skip
        return
    try:
        header = read_megatron_header(Path(f"{prefix}.idx"))
    except FormatError as exc:
        c.add(field, src.source, str(exc), "give a Megatron-LM PREFIX with .bin and .idx")
        return
    bin_size = Path(f"{prefix}.bin").stat().st_size
    if bin_size % DTYPE_SIZES[header.dtype]:
        c.add(
            field,
            src.source,
            f"{prefix}.bin has {bin_size} bytes, not a whole number of {header.dtype} ids",
            "give the .bin written together with this .idx",
        )


def _check_hf_disk(c: Checks, field: str, src: SourceConfig) -> None:
    root = Path(os.path.expanduser(src.source))
    dict_file = root / "dataset_dict.json"
    if dict_file.is_file():
        splits = read_mapping(dict_file, "a DatasetDict's dataset_dict.json").get("splits")
        splits = [s for s in splits if isinstance(s, str)] if isinstance(splits, list) else []
        if src.split not in splits:
            c.add(
                field,
                src.source,
                f"this DatasetDict has no split {src.split!r}; it has {splits}",
                "set data.split to one of them",
            )
            return
        root = root / src.split
    info = root / "dataset_info.json"
    features: Any = {}
    if info.is_file():
        features = read_mapping(info, "a dataset's dataset_info.json").get("features")
    if not isinstance(features, dict):
        features = {}
    if features and src.text_field not in features:
        c.add(
            field,
            src.source,
            f"no column {src.text_field!r}; the columns are {sorted(features)}",
            "set data.text_field to the column holding the text",
        )


def check_cache_dir(c: Checks, cfg: RecipeConfig) -> None:
    """cache_dir is a directory this process can write, or can be created."""
    root = cache_root(cfg.data)
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        c.add(
            "data.cache_dir",
            cfg.data.cache_dir,
            f"{existing} is a file, not a directory",
            "give a directory (it is created if missing)",
        )
    elif not os.access(existing, os.W_OK | os.X_OK):
        c.add(
            "data.cache_dir",
            cfg.data.cache_dir,
            f"{existing} is not writable here",
            "give a directory this user can write",
        )


def _check_prepared_folder(c: Checks, field: str, src: SourceConfig) -> None:
    fix = "prepare it again (action=prepare) or name the source it was made from"
    try:
        manifest = read_manifest(Path(os.path.expanduser(src.source)))
    except ReadError as err:
        c.add(field, src.source, f"its manifest cannot be used: {err.found}", fix)
        return
    if manifest is None:
        c.add(field, src.source, "no manifest.json: not a (complete) prepared dataset", fix)


def check_prepared_manifest(c: Checks, field: str, place: DatasetPlace, cfg: RecipeConfig) -> None:
    """A prepared dataset fits the recipe: made with its tokenizer, ids within its vocab."""
    try:
        manifest = read_manifest(place.folder)
    except ReadError as err:  # a cache entry cut short: preparing again replaces it
        c.add(field, place.source.source, f"{place.folder}: {err.found}",
              f"delete {place.folder} and prepare again (action=prepare)")  # fmt: skip
        return
    if manifest is None:
        return
    if place.kind == "prepared":
        path = tokenizer_file(cfg.data)
        made_with = manifest.get("tokenizer_sha256")
        recipe = file_sha256(path) if path is not None and path.is_file() else None
        if cfg.data.tokenizer == "train" or (path is not None and recipe != made_with):
            c.add(
                field,
                place.source.source,
                f"prepared with another tokenizer than data.tokenizer={cfg.data.tokenizer!r}",
                f"set data.tokenizer={place.folder / 'tokenizer.json'} (the one it was made "
                "with) or prepare the source again with this tokenizer",
            )
    top = manifest.get("max_token_id", -1)
    if top >= cfg.model.vocab_size:
        c.add(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"smaller than the ids of the prepared dataset {place.folder} (up to {top})",
            f"set model.vocab_size to at least {top + 1}",
        )


def check_data_on_disk(c: Checks, cfg: RecipeConfig) -> None:
    """Every I/O rule of the recipe's data: sources, tokenizer, cache dir, prepared datasets."""
    for field, src in source_fields(cfg):
        try:
            check_source(c, field, src, cfg)
        except OSError as exc:
            c.add(field, src.source, f"cannot be read ({exc})", "check the path and permissions")
    check_tokenizer(c, cfg)
    check_cache_dir(c, cfg)
    if c.problems:
        return  # the places below stat every file again: only for sources that are sound
    fields = [f for f, _ in source_fields(cfg)]
    for field, place in zip(fields, places_or_none(cfg), strict=True):
        if place is not None:
            check_prepared_manifest(c, field, place, cfg)


def places_or_none(cfg: RecipeConfig) -> list[DatasetPlace | None]:
    """The dataset places of the recipe's sources (None for one that cannot be resolved)."""
    try:
        return list(dataset_places(cfg.data, cfg.model.vocab_size))
    except (OSError, SourceError):
        return [None] * len(list(source_fields(cfg)))


def unprepared(cfg: RecipeConfig) -> list[tuple[str, DatasetPlace]]:
    """(field, place) of every source whose prepared dataset does not exist yet."""
    fields = [f for f, _ in source_fields(cfg)]
    places = dataset_places(cfg.data, cfg.model.vocab_size)
    return [(f, p) for f, p in zip(fields, places, strict=True) if read_manifest(p.folder) is None]
