"""Which sequences every step's global batch holds: a seeded function of (step, position).

No permutation of the sequences is ever stored. Each source's stream of sequences is, epoch
after epoch, a Feistel permutation of [0, n): a 4-round balanced Feistel network on the
smallest even number of bits that covers n, with a splitmix64 round function keyed from
(seed, source, epoch), made a bijection of [0, n) by cycle walking (an index that lands at
n or above is encrypted again; at most 4x the domain, so a few rounds on average). Each
index is computed where it is needed: O(1) memory for any n, vectorized over a batch.

A mixture draws its global batches from the sources by their shares, exactly and
deterministically (`core/data_order/mixture.py`): the shares are fixed by the weights or
scheduled over the tokens trained (`data.mixture_schedule`), and of the first N sequences of
the run source s supplies the count of its sequences among the N that fall due first, where
its j-th falls due as its running total of shares reaches j + 1/2 (exact fractions, so no
rounding differs between machines). Step k's batch is the sequences [N_k, N_(k+1)) of that
order, N_k the sequences before step k: k x global_batch, or under a batch-size ramp or
sequence-length warm-up (`core/data_order/ramps.py`) what the ramp's steps before k read. A
step of shorter sequences cuts each of its full-length sequences into train.seq_len /
seq_len pieces, in order. So the data order is the same under any parallelism and a run
resumes from its step alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pretrain.core.data_order.mixture import Mixture
from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import MixturePhase, TrainConfig

FEISTEL_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast 64-bit mixing function (uint64 in, uint64 out)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A seeded bijection of [0, n), evaluated index by index."""

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        """The permutation of [0, n) named by `key` (e.g. (seed, source, epoch))."""
        if n < 1:
            raise ValueError(f"need at least one element to permute, got n={n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence(list(key)).generate_state(FEISTEL_ROUNDS, np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of `indices` (each in [0, n)) as int64."""
        x = self._encrypt(np.asarray(indices, dtype=np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class MixtureSampler:
    """The (source, sequence) pairs of every step's global batch."""

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        *,
        ramp: Ramp | None = None,
        phases: Sequence[MixturePhase] = (),
    ) -> None:
        """`sizes[s]` full-length sequences of source s drawn in proportion to `weights[s]`
        (or by `phases`, data.mixture_schedule), `global_batch` a step (or as `ramp` says);
        without `shuffle` each source's sequences come in order (the validation batches)."""
        if not sizes or len(sizes) != len(weights) or min(sizes) < 1 or global_batch < 1:
            raise ValueError(
                f"need a positive global batch and at least one sequence per source, got "
                f"sizes={sizes}, weights={weights}, global_batch={global_batch}"
            )
        if min(weights) <= 0:
            raise ValueError(f"mixture weights must be positive, got {weights}")
        self.ramp = ramp if ramp is not None else Ramp(TrainConfig(global_batch=global_batch))
        self.mixture = Mixture(weights, self.ramp, phases)
        if self.mixture.sources != len(sizes):
            raise ValueError(f"{self.mixture.sources} mixture weights for {len(sizes)} sources")
        self.sizes = sizes
        self.weights = weights
        self.phases = list(phases)
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[tuple[int, int], FeistelPermutation] = {}

    def drawn(self, positions: int) -> list[int]:
        """How many of the first `positions` sequences of the run each source supplies."""
        return self.mixture.drawn(positions)

    def _permutation(self, source: int, epoch: int) -> FeistelPermutation:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4 * len(self.sizes):
                self._perms.clear()  # a batch spans few epochs: only recent ones are reused
            self._perms[key] = FeistelPermutation(self.sizes[source], (self.seed, *key))
        return self._perms[key]

    def _source_indices(self, source: int, first: int, stop: int) -> np.ndarray:
        """Positions [first, stop) of one source's stream of sequences."""
        n = self.sizes[source]
        positions = np.arange(first, stop, dtype=np.int64)
        if not self.shuffle:
            return positions % n
        out = np.empty_like(positions)
        epochs = positions // n
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(source, int(epoch))(positions[mask] % n)
        return out

    def global_batch_pairs(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, full-length sequence index) of each sequence of the data order that
        `step` reads, by source."""
        before = self.mixture.drawn_before(step)
        after = self.mixture.drawn_before(step + 1)
        sources, indices = [], []
        for s, (first, stop) in enumerate(zip(before, after, strict=True)):
            sources.append(np.full(stop - first, s, dtype=np.int64))
            indices.append(self._source_indices(s, first, stop))
        return np.concatenate(sources), np.concatenate(indices)

    def seq_len_pieces(self, step: int) -> int:
        """How many of `step`'s sequences are cut from one full-length sequence (1 unless a
        sequence-length warm-up shortens them)."""
        return self.ramp.phase(step).pieces

    def step_pairs(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, sequence index) of each of `step`'s global batch, the index among the
        source's sequences of the step's length: a full-length sequence i of r pieces gives
        sequences i*r ... i*r + r-1, which cover its tokens in order."""
        sources, indices = self.global_batch_pairs(step)
        r = self.seq_len_pieces(step)
        if r == 1:
            return sources, indices
        pieces = np.arange(r, dtype=np.int64)
        return np.repeat(sources, r), (indices[:, None] * r + pieces).reshape(-1)

    def rank_micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """This data-parallel rank's share of `step`'s global batch, as its accumulation
        micro-batches of (sources, indices); all ranks' shares make the global batch."""
        global_batch = self.ramp.phase(step).global_batch
        per_step = dp_size * micro_batch
        if global_batch % per_step != 0:
            raise ValueError(
                f"step {step}'s global_batch={global_batch} is not divisible by dp_size "
                f"({dp_size}) x micro_batch ({micro_batch}) = {per_step}; make it a multiple"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        accum = global_batch // per_step
        share = accum * micro_batch
        sources, indices = self.step_pairs(step)
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        sources, indices = sources[mine], indices[mine]
        return [
            (
                sources[i * micro_batch : (i + 1) * micro_batch],
                indices[i * micro_batch : (i + 1) * micro_batch],
            )
            for i in range(accum)
        ]

    def schedule(self) -> dict[str, list[list[Any]]]:
        """What a ramp and a mixture schedule make of the data order (empty without them):
        each phase's first step, global batch and seq_len; each mixture phase's first token,
        weights and blend."""
        found: dict[str, list[list[Any]]] = {}
        if self.ramp.active:
            found["ramp"] = [[p.first_step, p.global_batch, p.seq_len] for p in self.ramp.phases]
        if self.phases:
            found["mixture"] = [[p.from_tokens, list(p.weights), p.blend] for p in self.phases]
        return found

    def sequences_seen(self, steps: int) -> list[int]:
        """Full-length sequences each source supplied to the first `steps` steps."""
        return self.mixture.drawn_before(steps)
