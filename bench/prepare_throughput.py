"""Preparation throughput with 1 and N worker processes on a generated corpus.

    python -m bench.prepare_throughput [--mb 50] [--workers 1 2] [--files 64] [--rounds 2]

Writes a corpus of about `--mb` MB of JSONL (pseudo-random words, deterministic), trains a
byte-level BPE of 4096 tokens on its first 2 MB (not timed), then prepares the corpus into a
fresh cache dir per worker count and round (the counts alternate, so load from elsewhere
falls on each alike): the median time from the start of preparation to the manifest, the
tokens and text megabytes per second, and each rate over the 1-worker rate. Every worker
runs the tokenizer single-threaded, so the ratio is the scaling of the workers. "cores
used" is CPU seconds (this process and its workers) over wall seconds: on a machine shared
with other jobs it shows how much of the CPUs the run actually got.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.prepare import prepare_data
from pretrain.dataprep.tokenizer import train_bpe

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "data",
    "model",
    "token",
    "shard",
    "worker",
    "train",
    "loss",
    "batch",
    "layer",
    "attention",
    "prepare",
    "corpus",
    "weight",
    "über",
    "naïve",
    "café",
    "✓",
]


def write_corpus(root: Path, megabytes: float, files: int, seed: int = 0) -> int:
    """`files` JSONL files of documents of 50-400 words; returns the bytes of text."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    per_file = int(megabytes * 1e6 / files)
    total = 0
    for i in range(files):
        lines, size = [], 0
        while size < per_file:
            text = " ".join(words[rng.integers(0, len(words), rng.integers(50, 400))])
            lines.append(json.dumps({"text": text}))
            size += len(text) + 1
        (root / f"part-{i:04d}.jsonl").write_text("\n".join(lines) + "\n")
        total += size
    return total


def first_texts(root: Path, limit: int) -> list[str]:
    texts, size = [], 0
    for path in sorted(root.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size >= limit:
                return texts
    return texts


def measure(
    root: Path, tokenizer: Path, cache: Path, workers: int
) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds of this process and its workers, tokens, text bytes) of
    one preparation with `workers` processes."""
    cfg = RecipeConfig()
    cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir = str(root), str(tokenizer), str(cache)
    cfg.data.workers = workers
    start, before = time.perf_counter(), os.times()
    [(_, manifest)] = prepare_data(cfg, report=lambda line: None, tty=False)
    after = os.times()
    cpu = sum(after[i] - before[i] for i in range(4))  # user, system, children's user, system
    return time.perf_counter() - start, cpu, manifest["tokens"], manifest["text_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "corpus"
        root.mkdir()
        text_bytes = write_corpus(root, args.mb, args.files)
        tokenizer = Path(tmp) / "tokenizer.json"
        train_bpe([first_texts(root, 2_000_000)], 4096).save(str(tokenizer))
        print(
            f"{platform.machine()} CPU, {os.cpu_count()} cores; corpus {text_bytes / 1e6:.1f} MB "
            f"of text in {args.files} files; load average {os.getloadavg()[0]:.1f}"
        )
        times: dict[int, list[tuple[float, float]]] = {w: [] for w in args.workers}
        for r in range(args.rounds):
            for workers in args.workers:
                cache = Path(tmp) / f"cache-{r}-{workers}"
                seconds, cpu, tokens, nbytes = measure(root, tokenizer, cache, workers)
                times[workers].append((seconds, cpu))
                print(
                    f"round {r + 1}: {workers} worker(s) {seconds:.1f} s, {cpu:.1f} CPU s, "
                    f"load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        print("| workers | seconds (median) | tokens/s | MB/s | over 1 worker | cores used |")
        print("| --- | --- | --- | --- | --- | --- |")
        base = None
        for workers in args.workers:
            seconds = float(np.median([t for t, _ in times[workers]]))
            cpu = float(np.median([c for _, c in times[workers]]))
            rate = tokens / seconds
            base = base or rate
            print(
                f"| {workers} | {seconds:.1f} | {rate:,.0f} | {nbytes / 1e6 / seconds:.2f} | "
                f"{rate / base:.2f}x | {cpu / seconds:.2f} |"
            )


if __name__ == "__main__":
    main()
