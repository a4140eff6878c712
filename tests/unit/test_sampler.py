"""The sampler: a stored-nothing permutation per epoch, exact mixture proportions, the same
global batch under every layout."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from pretrain.trainer.data.sampler import FeistelPermutation, MixtureSampler

LAYOUTS = [(1, 16), (1, 4), (2, 8), (2, 4), (4, 1), (4, 2), (8, 2), (16, 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 2**16 + 1])
def test_the_feistel_permutation_is_a_bijection_of_0_to_n(n: int) -> None:
    images = FeistelPermutation(n, (5, 0, 0))(np.arange(n))
    assert np.array_equal(np.sort(images), np.arange(n))


def test_the_key_names_the_permutation() -> None:
    x = np.arange(1000)
    first = FeistelPermutation(1000, (1, 0, 0))(x)
    assert np.array_equal(first, FeistelPermutation(1000, (1, 0, 0))(x))
    for other in ((2, 0, 0), (1, 1, 0), (1, 0, 1)):
        assert np.mean(FeistelPermutation(1000, other)(x) == first) < 0.02
    assert np.mean(first == x) < 0.02  # it shuffles


def test_a_billion_sequences_cost_kilobytes_not_gigabytes() -> None:
    # numpy imports some modules on first use (numpy.ma, about 1 MB): not the sampler's.
    MixtureSampler([10], [1.0], global_batch=4, seed=0).global_batch_pairs(0)
    tracemalloc.start()
    sampler = MixtureSampler([10**9], [1.0], global_batch=1024, seed=0)
    batch = [sampler.global_batch_pairs(step)[1] for step in (0, 10**5, 10**6 - 1)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20  # a stored permutation would be 8 GB of int64
    assert all(len(b) == 1024 and b.max() < 10**9 for b in batch)


def test_every_layout_sees_exactly_the_global_batch_across_epochs() -> None:
    sampler = MixtureSampler([50], [1.0], global_batch=16, seed=3)
    for step in range(8):  # 8 * 16 = 128 positions: past two epoch boundaries
        expected = np.sort(sampler.global_batch_pairs(step)[1])
        for dp_size, micro_batch in LAYOUTS:
            shares = [
                mb
                for rank in range(dp_size)
                for _, mb in sampler.rank_micro_batches(step, rank, dp_size, micro_batch)
            ]
            assert all(len(mb) == micro_batch for mb in shares)
            assert np.array_equal(np.sort(np.concatenate(shares)), expected)


def test_each_epoch_is_a_fresh_permutation_of_all_sequences() -> None:
    n, g = 48, 16
    sampler = MixtureSampler([n], [1.0], global_batch=g, seed=0)
    stream = np.concatenate([sampler.global_batch_pairs(step)[1] for step in range(3 * n // g)])
    epochs = stream.reshape(3, n)
    for epoch in epochs:
        assert np.array_equal(np.sort(epoch), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])
    other = MixtureSampler([n], [1.0], global_batch=g, seed=1)
    assert not np.array_equal(other.global_batch_pairs(0)[1], sampler.global_batch_pairs(0)[1])


def test_a_mixture_draws_each_source_in_proportion_exactly() -> None:
    sampler = MixtureSampler([100, 37, 5], [0.5, 0.3, 0.2], global_batch=10, seed=4)
    for steps in (1, 7, 100, 1001):
        drawn = sampler.sequences_seen(steps)
        assert sum(drawn) == 10 * steps
        expected = [0.5 * 10 * steps, 0.3 * 10 * steps, 0.2 * 10 * steps]
        assert all(abs(d - e) < 1 for d, e in zip(drawn, expected, strict=True))
    for step in range(50):
        sources, indices = sampler.global_batch_pairs(step)
        assert len(sources) == 10
        for s, n in enumerate([100, 37, 5]):
            assert indices[sources == s].max(initial=0) < n
    # A small source cycles through fresh epochs: its 5 sequences appear equally often.
    sources, indices = zip(*(sampler.global_batch_pairs(k) for k in range(50)), strict=True)
    small = np.concatenate(indices)[np.concatenate(sources) == 2]
    assert np.bincount(small).tolist() == [20] * 5


def test_validation_batches_come_in_order() -> None:
    sampler = MixtureSampler([10], [1.0], global_batch=4, seed=9, shuffle=False)
    assert [sampler.global_batch_pairs(k)[1].tolist() for k in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


def test_bad_weights_and_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="weights must be positive"):
        MixtureSampler([10, 10], [1.0, 0.0], global_batch=4, seed=0)
    sampler = MixtureSampler([50], [1.0], global_batch=16, seed=0)
    with pytest.raises(ValueError, match=r"global_batch=16 is not divisible by dp_size \(3\)"):
        sampler.rank_micro_batches(0, 0, dp_size=3, micro_batch=2)
