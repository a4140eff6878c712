"""Rewrite the golden curves on purpose: `python -m tests.golden.regenerate [NAME ...]`.

Run it only when a change is meant to move the curves (say why in the commit), from the
repository root with the project installed. `--corpus` first rewrites the corpus they train
on (tests/golden/corpus.jsonl.xz) from the standard library of the Python that runs it,
which moves every curve: only on purpose, and in a commit of its own.
"""

from __future__ import annotations

import json
import lzma
import sys
import sysconfig
import tempfile
from pathlib import Path

from pretrain.dataprep.sources import stdlib_files
from tests.golden.cases import CASES, CORPUS, run_case, write_golden

CORPUS_FILES, CORPUS_FILE_BYTES = 300, 16_000
"""The corpus: the first 300 standard-library files of at most 16 KB, in path order (small
files, so that the 2% of documents held out for validation are 6)."""


def write_corpus() -> None:
    """`CORPUS` from this Python's standard library, one JSONL document per source file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib_files() if p.stat().st_size <= CORPUS_FILE_BYTES][:CORPUS_FILES]
    lines = [json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n" for p in files]
    # xz rather than zstd: the data checks read a JSONL's first line whole, which a zstd
    # stream cannot do when that line (here a whole source file) is longer than 4 KB.
    text = "".join(lines).encode()
    CORPUS.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME))
    print(f"{CORPUS}: {len(files)} files of {root}, {CORPUS.stat().st_size} bytes")


def main(names: list[str]) -> None:
    if "--corpus" in names:
        names.remove("--corpus")
        write_corpus()
    chosen = [c for c in CASES if not names or c.name in names]
    with tempfile.TemporaryDirectory() as tmp:
        for case in chosen:
            curve = run_case(case, Path(tmp) / case.name)
            write_golden(case, curve)
            print(f"{case.path}: loss {curve.loss[0]:.4f} -> {curve.loss[-1]:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
