"""Memory of the sampler for 10^9 sequences, against a stored permutation of them.

    python -m bench.sampler_memory [--sequences 1000000000] [--global-batch 1024]

The Feistel sampler (`trainer/data/sampler.py`) is built for `--sequences` sequences and asked
for the global batches of a few steps across the run (and past an epoch boundary); its
peak traced allocation is measured with tracemalloc. The sampler it replaced kept a seeded
`numpy` permutation of every sequence for two epochs: measured at 10^7 sequences and scaled
linearly (it is 8 bytes per sequence per epoch kept).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from pretrain.trainer.data.sampler import MixtureSampler

PERMUTATION_MEASURED_AT = 10**7


def feistel_peak(sequences: int, global_batch: int) -> tuple[int, float]:
    """(peak bytes, seconds per global batch) of the sampler over a spread of steps."""
    steps_per_epoch = sequences // global_batch
    steps = [0, 1, steps_per_epoch // 2, steps_per_epoch, 3 * steps_per_epoch + 7]

    def draw(sampler: MixtureSampler) -> None:
        for step in steps:
            sampler.rank_micro_batches(step, dp_rank=0, dp_size=8, micro_batch=global_batch // 8)

    draw(MixtureSampler([sequences], [1.0], global_batch, seed=1))  # numpy's lazy imports
    tracemalloc.start()
    draw(MixtureSampler([sequences], [1.0], global_batch, seed=1234))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    sampler = MixtureSampler([sequences], [1.0], global_batch, seed=1234)
    start = time.perf_counter()
    for _ in range(20):
        draw(sampler)
    return peak, (time.perf_counter() - start) / (20 * len(steps))


def permutation_bytes(sequences: int) -> int:
    """Measured bytes of one stored permutation of `sequences` (what the old sampler kept)."""
    tracemalloc.start()
    permutation = np.random.default_rng([1234, 0]).permutation(sequences)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del permutation
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10**9)
    parser.add_argument("--global-batch", type=int, default=1024)
    args = parser.parse_args()
    peak, seconds = feistel_peak(args.sequences, args.global_batch)
    measured = permutation_bytes(PERMUTATION_MEASURED_AT)
    stored = 2 * measured * args.sequences / PERMUTATION_MEASURED_AT
    print(
        f"| sequences | sampler | memory per rank | time per global batch of {args.global_batch} |"
    )
    print("| --- | --- | --- | --- |")
    print(
        f"| {args.sequences:.0e} | Feistel, nothing stored | {peak / 1024:.1f} KiB (measured) | "
        f"{seconds * 1e3:.2f} ms |"
    )
    print(
        f"| {args.sequences:.0e} | two stored permutations (before) | {stored / 2**30:.1f} GiB "
        f"(2 x {measured / 2**20:.1f} MiB measured at {PERMUTATION_MEASURED_AT:.0e}, "
        "scaled) | - |"
    )
    print(f"ratio: {stored / peak:,.0f}x less memory")


if __name__ == "__main__":
    main()
