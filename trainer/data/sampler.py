"""Which sequences every step's global batch holds: a seeded function of (step, position).

No permutation of the sequences is ever stored. Each source's stream of sequences is, epoch
after epoch, a Feistel permutation of [0, n): a 4-round balanced Feistel network on the
smallest even number of bits that covers n, with a splitmix64 round function keyed from
(seed, source, epoch), made a bijection of [0, n) by cycle walking (an index that lands at
n or above is encrypted again; at most 4x the domain, so a few rounds on average). Each
index is computed where it is needed: O(1) memory for any n, vectorized over a batch.

A mixture draws its global batches from the sources in proportion to their weights, exactly
and deterministically: of the first N sequences of the run, source s supplies
floor(N * W_s / W) - floor(N * W_(s-1) / W), with W_s the cumulative weight (exact
fractions, so no rounding differs between machines). Step k's batch is positions
[k*G, (k+1)*G) of that stream, whatever the layout: the data order is the same under any
parallelism and a run resumes from its step alone.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

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
    ) -> None:
        """`sizes[s]` sequences of source s drawn in proportion to `weights[s]`;
        without `shuffle` each source's sequences come in order (the validation batches)."""
        if not sizes or len(sizes) != len(weights) or min(sizes) < 1 or global_batch < 1:
            raise ValueError(
                f"need a positive global batch and at least one sequence per source, got "
                f"sizes={sizes}, weights={weights}, global_batch={global_batch}"
            )
        exact = [Fraction(str(w)) for w in weights]
        if min(exact) <= 0:
            raise ValueError(f"mixture weights must be positive, got {weights}")
        total = sum(exact)
        self.bounds = [sum(exact[: s + 1]) / total for s in range(len(exact))]
        self.sizes = sizes
        self.weights = weights
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[tuple[int, int], FeistelPermutation] = {}

    def drawn(self, positions: int) -> list[int]:
        """How many of the first `positions` sequences of the run each source supplies."""
        upper = [int(positions * b) for b in self.bounds]
        upper[-1] = positions
        return [u - lower for u, lower in zip(upper, [0, *upper[:-1]], strict=True)]

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
        """(source, sequence index) of each of step's `global_batch` sequences, by source."""
        before = self.drawn(step * self.global_batch)
        after = self.drawn((step + 1) * self.global_batch)
        sources, indices = [], []
        for s, (first, stop) in enumerate(zip(before, after, strict=True)):
            sources.append(np.full(stop - first, s, dtype=np.int64))
            indices.append(self._source_indices(s, first, stop))
        return np.concatenate(sources), np.concatenate(indices)

    def rank_micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """This data-parallel rank's share of `step`'s global batch, as its accumulation
        micro-batches of (sources, indices); all ranks' shares make the global batch."""
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
        sources, indices = self.global_batch_pairs(step)
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        sources, indices = sources[mine], indices[mine]
        return [
            (
                sources[i * micro_batch : (i + 1) * micro_batch],
                indices[i * micro_batch : (i + 1) * micro_batch],
            )
            for i in range(accum)
        ]

    def sequences_seen(self, steps: int) -> list[int]:
        """Sequences each source supplied to the first `steps` steps."""
        return self.drawn(steps * self.global_batch)
