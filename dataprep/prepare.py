"""Prepare a recipe's data: tokenizer, then every source into a sharded, versioned dataset.

    python -m pretrain.dataprep.prepare RUN_DIR/prepare.yaml     (what `pretrain action=prepare`
    runs)

A text source is planned into work units (`dataprep/corpus.py`) that `data.workers` spawned
processes tokenize in parallel (`dataprep/shards.py`, `dataprep/workers.py`); units
finish in any order but count in order, so `max_tokens`/`max_bytes` cut the same documents whatever
the worker count, and units past the cut are dropped. A stopped preparation (Ctrl-C,
SIGTERM, a killed job) keeps every finished unit; the next one redoes only the rest. The
manifest, written last and atomically, makes the dataset usable: nothing half-written is
ever read. One preparation of a dataset runs at a time (a file lock beside it); others wait
and reuse it.

PRETRAIN_FAULT_PREPARE_STOP=N (tests only): stop as SIGTERM would once N units finish.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.core.problems import Checks
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.dataprep.cache_lock import Holding, held
from pretrain.dataprep.checks import check_data_on_disk
from pretrain.dataprep.corpus import plan_units
from pretrain.dataprep.dataset_manifest import read_manifest
from pretrain.dataprep.progress import Progress
from pretrain.dataprep.shards import SHARD_TOKENS, UnitJob, read_marker, write_json_atomic
from pretrain.dataprep.sources import (
    DATASET_VERSION,
    MANIFEST,
    TOKENIZER_FILE,
    DatasetPlace,
    dataset_places,
    file_sha256,
    source_identity,
    tokenizer_spec,
)
from pretrain.dataprep.token_sources import token_shard
from pretrain.dataprep.tokenizer import eos_id, load_tokenizer, max_token_id
from pretrain.dataprep.workers import Frontier, default_workers, tokenize_here, tokenize_in_pool

Report = Callable[[str], None]


def _cut_parts(
    kept: list[dict[str, Any]], folder: Path, max_tokens: int, max_bytes: int
) -> list[dict[str, Any]]:
    """The shard parts the dataset uses, the last one possibly only up to the document at
    which max_tokens or max_bytes is reached."""
    parts: list[dict[str, Any]] = []
    tokens = text_bytes = 0
    for part in (p for record in kept for p in record["parts"]):
        over_tokens = 0 < max_tokens <= tokens + part["tokens"]
        over_bytes = 0 < max_bytes <= text_bytes + part["text_bytes"]
        if not (over_tokens or over_bytes):
            parts.append(part)
            tokens, text_bytes = tokens + part["tokens"], text_bytes + part["text_bytes"]
            continue
        ends = np.load(folder / part["docs"])
        last = len(ends) - 1
        if over_tokens:
            last = min(last, int(np.searchsorted(ends[:, 0], max_tokens - tokens)))
        if over_bytes:
            last = min(last, int(np.searchsorted(ends[:, 1], max_bytes - text_bytes)))
        parts.append(
            {
                **part,
                "tokens": int(ends[last, 0]),
                "documents": last + 1,
                "text_bytes": int(ends[last, 1]),
            }
        )
        break
    return parts


def _clean(folder: Path, keep: set[str]) -> None:
    """Remove what the dataset does not use: .tmp files, units past the cut."""
    for path in folder.iterdir():
        if path.name.startswith("u") and path.name not in keep:
            path.unlink()


def _manifest(
    place: DatasetPlace, shards: list[dict[str, Any]], extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "version": DATASET_VERSION,
        "key": place.key,
        "kind": place.kind,
        "source": place.source.source,
        "identity": source_identity(place.source),
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
        "shards": shards,
        **extra,
    }


def prepare_text_source(
    place: DatasetPlace,
    tokenizer: Any,
    tokenizer_path: Path,
    workers: int,
    report: Report,
    tty: bool | None = None,
    holding: Holding | None = None,
) -> dict[str, Any]:
    """Tokenize a text source into `place.folder` (resuming), then write its manifest; the
    progress goes to `report` and to the lock's note for the processes waiting on it."""
    src, folder = place.source, place.folder
    eos = eos_id(tokenizer)
    dtype = "uint16" if max_token_id(tokenizer) < 2**16 else "uint32"
    units = plan_units(src)
    frontier = Frontier(units, src.max_tokens, src.max_bytes)
    for unit in units:
        record = read_marker(folder, unit)
        if record is not None:
            frontier.add(record)
    jobs = [
        UnitJob(src, u, str(folder), dtype, SHARD_TOKENS)
        for u in units
        if u.index not in frontier.records
    ]
    workers = max(1, min(workers, len(jobs)))
    total = sum(u.input_bytes for u in units)
    if frontier.records:
        report(
            f"data: resuming {src.source!r}: {len(frontier.records)} of {len(units)} units "
            "already done"
        )
    publish = holding.publish if holding is not None else None
    goals = (src.max_tokens, src.max_bytes)
    progress = Progress(src.source, len(units), total, goals, report, tty, publish)
    progress.resumed(
        len(frontier.records),
        sum(u.input_bytes for u in units if u.index in frontier.records),
        sum(r["tokens"] for r in frontier.records.values()),
        sum(r["text_bytes"] for r in frontier.records.values()),
    )
    start = time.perf_counter()
    if not frontier.complete:
        if workers == 1:
            tokenize_here(jobs, tokenizer, eos, frontier, progress)
        else:
            tokenize_in_pool(jobs, tokenizer_path, eos, workers, frontier, progress)
    progress.finish()
    kept = frontier.kept()
    parts = _cut_parts(kept, folder, src.max_tokens, src.max_bytes)
    _clean(
        folder,
        {n for p in parts for n in (p["file"], p["docs"])}
        | {f"u{r['unit']['index']:06d}.json" for r in kept},
    )
    if frontier.cut:
        report(_cut_line(src.source, parts, total, src.max_tokens, src.max_bytes))
    shards = [{**p, "dtype": dtype, "offset": 0} for p in parts]
    return _manifest(
        place,
        shards,
        {
            "dtype": dtype,
            "eos_id": eos,
            "max_token_id": max((r["max_token_id"] for r in kept), default=-1),
            "text_bytes": sum(p["text_bytes"] for p in parts),
            "units": len(kept),
            "workers": workers,
            "seconds": round(time.perf_counter() - start, 3),
        },
    )


def _cut_line(
    source: str, parts: list[dict[str, Any]], input_bytes: int, max_tokens: int, max_bytes: int
) -> str:
    """Say that (and where) the dataset stops before the end of its source: a cut that goes
    unsaid looks like the whole corpus."""
    tokens = sum(p["tokens"] for p in parts)
    text_bytes = sum(p["text_bytes"] for p in parts)
    by_bytes = 0 < max_bytes <= text_bytes
    field, limit = ("data.max_bytes", max_bytes) if by_bytes else ("data.max_tokens", max_tokens)
    return (
        f"data: {source!r} is cut at {field}={limit:,}: the first "
        f"{sum(p['documents'] for p in parts):,} documents ({tokens:,} tokens, {text_bytes:,} "
        f"bytes of text; the source has {input_bytes:,} bytes); {field}=0 takes all of it"
    )


def prepare_token_source(place: DatasetPlace, eos: int | None) -> dict[str, Any]:
    """Index a nanoGPT or Megatron file in place and write its manifest."""
    found = token_shard(place, eos)
    ends = found.pop("ends")
    limit = place.source.max_tokens
    if limit and len(ends) and ends[-1] > limit:
        ends = ends[: int(np.searchsorted(ends, limit)) + 1]
    index = np.stack([ends, np.zeros_like(ends)], axis=1)
    docs = place.folder / "external.000.docs.npy"
    with open(docs.with_name(docs.name + ".tmp"), "wb") as f:
        np.save(f, index)
    os.replace(docs.with_name(docs.name + ".tmp"), docs)
    shard = {
        "file": found["file"],
        "docs": docs.name,
        "dtype": found["dtype"],
        "offset": found["offset"],
        "tokens": int(ends[-1]) if len(ends) else 0,
        "documents": len(ends),
        "text_bytes": 0,
    }
    return _manifest(
        place,
        [shard],
        {
            "dtype": found["dtype"],
            "eos_id": eos,
            "max_token_id": found["max_token_id"],
            "vocab_size": found["vocab_size"],
        },
    )


def dataset_lock(place: DatasetPlace) -> Path:
    """The lock its preparation holds (beside the dataset's folder)."""
    return place.folder.parent / f"{place.key}.lock"


def _prepare_one(
    cfg: RecipeConfig, place: DatasetPlace, workers: int, report: Report, tty: bool | None
) -> dict[str, Any]:
    """Prepare one dataset unless it is; one process at a time, others wait (showing it)
    and reuse it."""
    if place.kind == "prepared":
        manifest = read_manifest(place.folder)
        assert manifest is not None  # validation refused a prepared dir without one
        return manifest
    place.folder.mkdir(parents=True, exist_ok=True)
    waiting = f"data: waiting for the preparation of {place.source.source!r} in {place.folder}"
    with held(dataset_lock(place), waiting, report, tty) as holding:
        manifest = read_manifest(place.folder)
        if manifest is not None:
            return manifest
        spec = tokenizer_spec(cfg.data, cfg.model.vocab_size)
        extra: dict[str, Any] = {"tokenizer_spec": spec, "tokenizer_sha256": None}
        if cfg.data.tokenizer == "none":
            manifest = prepare_token_source(place, None)
        else:
            holding.publish(None, f"preparing the tokenizer of {place.source.source!r}")
            tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size, report, tty)
            copy = place.folder / TOKENIZER_FILE
            tokenizer.save(str(copy))
            extra["tokenizer_sha256"] = file_sha256(copy)
            if place.kind in ("nanogpt", "megatron"):
                manifest = prepare_token_source(place, eos_id(tokenizer))
            else:
                manifest = prepare_text_source(
                    place, tokenizer, copy, workers, report, tty, holding
                )
        manifest.update(extra, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        write_json_atomic(place.folder / MANIFEST, manifest)
        report(
            f"data: {place.source.source!r}: {manifest['documents']:,} documents, "
            f"{manifest['tokens']:,} {manifest['dtype']} tokens in {len(manifest['shards'])} "
            f"shard(s) -> {place.folder}"
        )
        return manifest


def prepare_data(
    cfg: RecipeConfig, report: Report = print, workers: int = 0, tty: bool | None = None
) -> list[tuple[DatasetPlace, dict[str, Any]]]:
    """Check the recipe's data on disk, then prepare every source the run reads (training
    sources, then data.val_source); (place, manifest) of each."""
    checks = Checks()
    check_data_on_disk(checks, cfg)
    checks.raise_if_any()
    workers = workers or cfg.data.workers or default_workers()
    places = dataset_places(cfg.data, cfg.model.vocab_size)
    return [(place, _prepare_one(cfg, place, workers, report, tty)) for place in places]


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(config_path: str) -> int:
    """Prepare the data of a resolved recipe; 0 when every dataset is ready."""
    from pretrain.core.problems import RecipeError

    cfg = load_config(config_path)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        prepared = prepare_data(cfg)
    except RecipeError as err:
        print(f"Recipe '{cfg.name}' cannot be prepared:\n{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(
            f"\ndata: stopped ({stop or 'SIGINT'}); finished units are kept, run again to resume",
            file=sys.stderr,
        )
        return 130 if not str(stop) else 143
    for place, manifest in prepared:
        print(f"prepared: {place.folder} ({manifest['tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    from pretrain.core.inputs.boundary import run_command

    if len(sys.argv) != 2:
        sys.exit("usage: python -m pretrain.dataprep.prepare RUN_DIR/prepare.yaml")
    run_command("prepare", lambda: main(sys.argv[1]))
