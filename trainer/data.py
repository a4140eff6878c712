"""The data pipeline: tokenize the corpus once into a flat memory-mapped token file, pack it
into fixed-length sequences, and sample global batches that do not depend on the layout.

Documents are concatenated with EOS after each; sequence i is tokens[i*L : i*L + L + 1]
(inputs are its first L tokens, targets its last L). The global batch of step k is a fixed set
of sequences, whatever the data-parallel degree, micro-batch or accumulation, so a run can
resume under another layout and see exactly the same data.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tokenizers import Tokenizer

from trainer.corpus import (
    build_once,
    cache_root,
    corpus_identity,
    identity_hash,
    iter_document_batches,
)
from trainer.tokenizer import eos_id, load_tokenizer, max_token_id, tokenizer_hash

if TYPE_CHECKING:
    from pretrain_core.schema import DataConfig

TOKEN_FILE_VERSION = 1
"""Bump when the token file's layout or content rules change, so caches are rebuilt."""

TOKENS_NAME = "tokens.bin"
META_NAME = "meta.json"


def token_file_key(data: DataConfig, tokenizer: Tokenizer) -> str:
    """Cache key of a token file: the corpus identity, the tokenizer's content and our version."""
    return identity_hash(
        {
            "corpus": corpus_identity(data),
            "tokenizer": tokenizer_hash(tokenizer),
            "version": TOKEN_FILE_VERSION,
        }
    )


def token_dtype(tokenizer: Tokenizer) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32: half the disk and page cache."""
    return np.dtype(np.uint16 if max_token_id(tokenizer) < 2**16 else np.uint32)


def _write_tokens(data: DataConfig, tokenizer: Tokenizer, folder: Path) -> dict[str, Any]:
    dtype = token_dtype(tokenizer)
    eos = eos_id(tokenizer)
    tmp = folder / (TOKENS_NAME + ".tmp")
    num_tokens = num_documents = num_bytes = 0
    with open(tmp, "wb") as out:
        for texts in iter_document_batches(data):
            encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
            ids = []
            for encoding in encodings:
                ids.extend(encoding.ids)
                ids.append(eos)
            out.write(np.asarray(ids, dtype=dtype).tobytes())
            num_tokens += len(ids)
            num_documents += len(texts)
            num_bytes += sum(len(text.encode("utf-8")) for text in texts)
    os.replace(tmp, folder / TOKENS_NAME)
    return {
        "version": TOKEN_FILE_VERSION,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "num_documents": num_documents,
        "num_bytes": num_bytes,
        "eos_id": eos,
        "vocab_size": tokenizer.get_vocab_size(),
        "tokenizer": tokenizer_hash(tokenizer),
        "source": data.source,
        "builder_pid": os.getpid(),
    }


def build_token_file(data: DataConfig, tokenizer: Tokenizer) -> Path:
    """The folder holding the corpus's token file, building it exactly once: concurrent callers
    wait on a file lock while the first one builds; the metadata, written last, marks it done."""
    folder = cache_root(data) / "tokens" / token_file_key(data, tokenizer)

    def build() -> None:
        start = time.perf_counter()
        meta = _write_tokens(data, tokenizer, folder)
        tmp = folder / (META_NAME + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, folder / META_NAME)
        size = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        print(
            f"data: tokenized {meta['num_documents']} documents ({meta['num_bytes'] / 1e6:.1f} MB)"
            f" into {meta['num_tokens']:,} {meta['dtype']} tokens ({size / 1e6:.1f} MB) in "
            f"{time.perf_counter() - start:.1f}s -> {folder}",
            flush=True,
        )

    build_once(folder / META_NAME, build)
    return folder


class PackedDataset:
    """Fixed-length training sequences over a token file; they cross document boundaries."""

    def __init__(self, folder: str | os.PathLike[str], seq_len: int) -> None:
        """Open the token file built in `folder` (by `build_token_file`) as `seq_len` sequences."""
        self.folder = Path(folder)
        self.meta: dict[str, Any] = json.loads((self.folder / META_NAME).read_text())
        self.seq_len = seq_len
        self.eos_id: int = self.meta["eos_id"]
        num_tokens = self.meta["num_tokens"]
        if num_tokens < seq_len + 1:
            raise ValueError(
                f"the corpus in {self.folder} has {num_tokens} tokens, fewer than one sequence "
                f"of train.seq_len={seq_len} needs ({seq_len + 1}); use more data "
                f"(data.max_bytes) or a shorter seq_len"
            )
        self.tokens = np.memmap(
            self.folder / TOKENS_NAME, dtype=self.meta["dtype"], mode="r", shape=(num_tokens,)
        )

    def __len__(self) -> int:
        """Number of full sequences (each needs seq_len + 1 tokens, the last one shared)."""
        return (len(self.tokens) - 1) // self.seq_len

    def sequence(self, index: int) -> np.ndarray:
        """Tokens [index*L, index*L + L + 1) as int64: inputs and targets of one sequence."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of sequence `index`, each of shape (seq_len,)."""
        seq = torch.from_numpy(self.sequence(index))
        return seq[:-1], seq[1:]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given sequences, each a LongTensor (len(indices), seq_len)."""
        seqs = torch.from_numpy(np.stack([self.sequence(int(i)) for i in indices]))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def prepare_dataset(data: DataConfig, *, vocab_size: int, seq_len: int) -> PackedDataset:
    """Corpus → tokenizer → token file → packed sequences, each step cached under
    `data.cache_dir` and built once however many processes call this together."""
    tokenizer = load_tokenizer(data, vocab_size)
    return PackedDataset(build_token_file(data, tokenizer), seq_len)


class GlobalBatchSampler:
    """Global batches drawn from an endless stream of seeded per-epoch permutations.

    The stream is perm(epoch 0), perm(epoch 1), ...; step k's global batch is its positions
    [k*G, (k+1)*G). It depends only on (num_sequences, global_batch, seed), never on the layout.
    """

    def __init__(self, num_sequences: int, global_batch: int, seed: int) -> None:
        """Sample `global_batch` of `num_sequences` sequences per step, shuffled by `seed`."""
        if num_sequences < 1 or global_batch < 1:
            raise ValueError(
                f"need at least one sequence and a positive global batch, got "
                f"num_sequences={num_sequences}, global_batch={global_batch}"
            )
        self.num_sequences = num_sequences
        self.global_batch = global_batch
        self.seed = seed
        self._permutations: dict[int, np.ndarray] = {}

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The order of all sequences in `epoch`, seeded by (seed, epoch)."""
        if epoch not in self._permutations:
            # A batch spans at most a few epochs; keep only the latest two in memory.
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_sequences)
        return self._permutations[epoch]

    def global_batch_indices(self, step: int) -> np.ndarray:
        """The `global_batch` sequence indices of `step`."""
        position, stop = step * self.global_batch, (step + 1) * self.global_batch
        parts = []
        while position < stop:
            epoch, offset = divmod(position, self.num_sequences)
            take = min(stop - position, self.num_sequences - offset)
            parts.append(self.epoch_permutation(epoch)[offset : offset + take])
            position += take
        return np.concatenate(parts)

    def rank_micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[np.ndarray]:
        """This data-parallel rank's share of `step`'s global batch, as its accumulation
        micro-batches of `micro_batch` indices each; all ranks' shares make the global batch."""
        per_step = dp_size * micro_batch
        if self.global_batch % per_step != 0:
            raise ValueError(
                f"train.global_batch={self.global_batch} is not divisible by dp_size "
                f"({dp_size}) x micro_batch ({micro_batch}) = {per_step}; make it a multiple"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        accum = self.global_batch // per_step
        share = accum * micro_batch
        mine = self.global_batch_indices(step)[dp_rank * share : (dp_rank + 1) * share]
        return [mine[i * micro_batch : (i + 1) * micro_batch] for i in range(accum)]


class DataLoader:
    """One data-parallel rank's micro-batches, step after step, resumable from a small state."""

    def __init__(
        self,
        dataset: PackedDataset,
        sampler: GlobalBatchSampler,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        start_step: int = 0,
    ) -> None:
        """Serve rank `dp_rank` of `dp_size` in micro-batches, starting at `start_step`."""
        if sampler.num_sequences != len(dataset):
            raise ValueError(
                f"sampler covers {sampler.num_sequences} sequences but the dataset has "
                f"{len(dataset)}"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch = micro_batch
        self.step = start_step

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per accumulation micro-batch of the next step, each of shape
        (micro_batch, seq_len); advances the position by one step."""
        micro_batches = self.sampler.rank_micro_batches(
            self.step, self.dp_rank, self.dp_size, self.micro_batch
        )
        self.step += 1
        return [self.dataset.batch(indices) for indices in micro_batches]

    def state_dict(self) -> dict[str, int]:
        """The position (the next step) and what it is valid for; the same on every rank."""
        return {
            "step": self.step,
            "seed": self.sampler.seed,
            "global_batch": self.sampler.global_batch,
            "num_sequences": self.sampler.num_sequences,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; refuses one saved for another seed, batch or dataset."""
        expected = self.state_dict()
        mismatches = [
            f"{key}: saved {state.get(key)}, now {expected[key]}"
            for key in ("seed", "global_batch", "num_sequences")
            if state.get(key) != expected[key]
        ]
        if mismatches:
            raise ValueError(
                "data loader state was saved for a different data order ("
                + "; ".join(mismatches)
                + "); resume with the same seed, train.global_batch and data/seq_len, "
                "or start a new run"
            )
        self.step = int(state["step"])
