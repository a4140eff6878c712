"""Read a prepared dataset: memory-mapped shards, the validation split, packed sequences.

The training stream of a source is its shards' tokens back to back, each shard without its
validation tail; the validation stream is those tails back to back. Of the D_s documents of
shard s, the last floor(f * C_s) - floor(f * C_(s-1)) are held out (C_s: documents of the
first s shards, f: data.val_fraction), so exactly floor(f * D) documents of the source are,
spread over its shards in proportion, and the split is fixed by the manifest and f alone.
A source of one document in all (a flat token file without end-of-sequence tokens, as
nanoGPT's `train.bin` read with `data.tokenizer=none`, or a single text file) is split by
token range instead: its last floor(f * T) tokens are held out.

Sequence i of a stream is its tokens [i*L, i*L + L + 1): inputs the first L, targets the
last L; sequences cross document and shard boundaries. Shards are memory-mapped when first
read and at most OPEN_SHARDS stay mapped, so a dataset of thousands of shards needs no more
file descriptors than that.
"""

from __future__ import annotations

from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.core.inputs.reading import MissingFile
from pretrain.dataprep.dataset_manifest import MANIFEST, read_manifest

OPEN_SHARDS = 64

Region = tuple[int, int, int]
"""(shard, first token, end token) of a stretch of a stream."""


class PreparedDataset:
    """A prepared dataset directory: its manifest and its shards, mapped on demand."""

    def __init__(self, folder: str | Path) -> None:
        """Open the dataset `prepare` wrote in `folder` (its manifest must exist)."""
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise MissingFile(
                self.folder / MANIFEST, "no such file", "a prepared dataset", "prepare it"
            )
        self.manifest: dict[str, Any] = manifest
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        self.eos_id: int | None = self.manifest.get("eos_id")
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()

    def _path(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.folder / path

    def tokens(self, shard: int) -> np.ndarray:
        """The token ids a shard holds (a read-only memory map)."""
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        info = self.shards[shard]
        mapped = np.memmap(
            self._path(info["file"]),
            dtype=info["dtype"],
            mode="r",
            offset=info.get("offset", 0),
            shape=(info["tokens"],),
        )
        self._open[shard] = mapped
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return mapped

    def document_ends(self, shard: int) -> np.ndarray:
        """Cumulative token end of each document the shard uses (int64)."""
        info = self.shards[shard]
        ends = np.load(self._path(info["docs"]), mmap_mode="r")
        return ends[: info["documents"], 0]

    def split(self, val_fraction: float) -> tuple[list[Region], list[Region]]:
        """The (training, validation) regions of every shard for `val_fraction`."""
        fraction = Fraction(str(val_fraction))
        train: list[Region] = []
        val: list[Region] = []
        seen = 0
        # Only a source of one document in all (a flat token file, one text file) is split by
        # tokens: a shard of one document among others is held out whole or not at all.
        single_document = sum(info["documents"] for info in self.shards) == 1
        for s, info in enumerate(self.shards):
            if single_document and fraction > 0:
                # One document cannot be held out in part: split the flat stream by tokens.
                cut = info["tokens"] - int(fraction * info["tokens"])
                train.append((s, 0, cut))
                val.append((s, cut, info["tokens"]))
                continue
            before = int(fraction * seen)
            seen += info["documents"]
            held = int(fraction * seen) - before
            kept = info["documents"] - held
            cut = int(self.document_ends(s)[kept - 1]) if kept > 0 else 0
            if cut > 0:
                train.append((s, 0, cut))
            if info["tokens"] > cut:
                val.append((s, cut, info["tokens"]))
        return train, val

    def everything(self) -> list[Region]:
        """Every shard whole: a dataset used only for validation (data.val_source)."""
        return [(s, 0, info["tokens"]) for s, info in enumerate(self.shards) if info["tokens"]]


class TokenStream:
    """Regions of a dataset's shards read as one stream of tokens."""

    def __init__(self, dataset: PreparedDataset, regions: list[Region]) -> None:
        self.dataset = dataset
        self.regions = regions
        lengths = [end - start for _, start, end in regions]
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream as int64, across regions."""
        if start < 0 or start + count > len(self):
            raise IndexError(f"tokens [{start}, {start + count}) outside a stream of {len(self)}")
        out = np.empty(count, dtype=np.int64)
        filled = 0
        region = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < count:
            shard, first, end = self.regions[region]
            offset = first + start + filled - int(self.starts[region])
            take = min(count - filled, end - offset)
            out[filled : filled + take] = self.dataset.tokens(shard)[offset : offset + take]
            filled += take
            region += 1
        return out


class PackedSequences:
    """Fixed-length sequences over a token stream; they cross document boundaries."""

    def __init__(self, stream: TokenStream, seq_len: int, name: str = "") -> None:
        """Sequences of `seq_len` (+1 for the shifted targets) over `stream`."""
        if len(stream) < seq_len + 1:
            raise ValueError(
                f"{name or 'the dataset'} has {len(stream)} tokens, fewer than one sequence "
                f"of train.seq_len={seq_len} needs ({seq_len + 1}); use more data or a "
                f"shorter seq_len"
            )
        self.stream = stream
        self.seq_len = seq_len
        self.name = name

    def __len__(self) -> int:
        """Number of full sequences (each needs seq_len + 1 tokens, the last one shared)."""
        return (len(self.stream) - 1) // self.seq_len

    def sequence(self, index: int) -> np.ndarray:
        """Tokens [index*L, index*L + L + 1) as int64: inputs and targets of one sequence."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        return self.stream.read(index * self.seq_len, self.seq_len + 1)

    def batch(self, indices: np.ndarray) -> np.ndarray:
        """The given sequences stacked: int64 [len(indices), seq_len + 1]."""
        return np.stack([self.sequence(int(i)) for i in indices])
