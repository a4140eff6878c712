"""Mixture shares, fixed or scheduled over the tokens trained, turned into exact counts: the
closed form against step-by-step sums, the counts against the Webster order built by
sorting every due point, each batch's size, and the steps of a ramp cut from the same
stream of sequences."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from pretrain.core.data_order.mixture import Mixture
from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import BatchStage, MixturePhase, SeqLenStage, TrainConfig
from pretrain.trainer.data.sampler import MixtureSampler

HALF = Fraction(1, 2)
RAMP = TrainConfig(
    global_batch=8,
    seq_len=16,
    batch_schedule=[BatchStage(2, 100), BatchStage(4, 300)],
    seq_len_schedule=[SeqLenStage(8, 60)],
)
PHASES = [
    MixturePhase("warm", 0, [1.0, 0.0, 0.5], blend=True),
    MixturePhase("main", 200, [0.5, 0.3, 0.2]),
    MixturePhase("anneal", 700, [0.0, 1.0, 0.0]),
]


def brute_force(mix: Mixture, steps: int) -> tuple[list[list[Fraction]], list[tuple]]:
    """Each step's running totals, summed step by step from the shares at its first token,
    and every due point (x, source) of those steps, sorted: the Webster order itself."""
    ramp, totals, due = mix.ramp, [Fraction(0)] * mix.sources, []
    before = []
    for step in range(steps):
        tokens, start = ramp.tokens_before(step), ramp.units_before(step)
        end = ramp.units_before(step + 1)
        segment = [s for s in mix.segments if s.start <= tokens][-1]
        pairs = zip(segment.shares, segment.slope, strict=True)
        shares = [q + d * (tokens - segment.start) for q, d in pairs]
        before.append(list(totals))
        for s, share in enumerate(shares):
            j = int(totals[s] + HALF)  # the next sequence of source s to fall due
            while share and totals[s] + (end - start) * share >= j + HALF:
                due.append((start + (j + HALF - totals[s]) / share, s))
                j += 1
        totals = [f + (end - start) * q for f, q in zip(totals, shares, strict=True)]
    return before, sorted(due)


@pytest.mark.parametrize(
    ("train", "phases"),
    [(TrainConfig(global_batch=4), []), (RAMP, []), (TrainConfig(global_batch=4), PHASES),
     (RAMP, PHASES)],
)  # fmt: skip
def test_counts_are_the_prefixes_of_the_webster_order(train, phases) -> None:
    mix = Mixture([3, 1, 1], Ramp(train), phases)
    steps = 40
    totals, due = brute_force(mix, steps)
    assert [mix.totals(k) for k in range(steps)] == totals  # the closed form
    drawn = [0, 0, 0]
    for n in range(len(due) - 3):
        assert mix.drawn(n) == drawn
        drawn[due[n][1]] += 1


@pytest.mark.parametrize("sources", [2, 3, 4])
def test_every_count_stays_near_its_running_share(sources: int) -> None:
    rng = random.Random(sources)
    worst = Fraction(0)
    for _ in range(5):
        weights = [rng.choice([1, 2, 5, 0.3]) for _ in range(sources)]
        phases = [
            MixturePhase("", 0, [rng.choice([0, 1, 3]) + 0.5 for _ in range(sources)], True),
            MixturePhase("", rng.randint(1, 900), [rng.choice([0, 1, 4]) + 0.1 for _ in weights]),
        ]
        mix = Mixture(weights, Ramp(RAMP), phases)
        for n in range(0, 300, 7):
            totals = mix.totals_at(Fraction(n))
            worst = max(worst, *(abs(d - f) for d, f in zip(mix.drawn(n), totals, strict=True)))
    # Measured: 1/2 for two sources, 0.76 for three, 1.01 for four.
    assert worst <= {2: HALF, 3: 1, 4: Fraction(3, 2)}[sources]


def test_a_fixed_mixture_draws_its_exact_shares_every_step() -> None:
    sampler = MixtureSampler([100, 100], [3, 1], global_batch=8, seed=0)
    for step in range(20):
        sources, _ = sampler.global_batch_pairs(step)
        assert np.bincount(sources, minlength=2).tolist() == [6, 2]


def test_a_small_share_of_a_small_batch_never_draws_a_negative_count() -> None:
    # Floors of nested cumulative sums gave source 1 a count of -1 at step 5 here.
    sampler = MixtureSampler([100, 100, 100], [0.5, 0.1, 0.4], global_batch=1, seed=0)
    sources = np.concatenate([sampler.global_batch_pairs(k)[0] for k in range(100)])
    assert len(sources) == 100
    assert np.bincount(sources).tolist() == [50, 10, 40]


def test_a_phase_of_zero_weight_leaves_its_source_out_and_the_anneal_takes_all() -> None:
    train = TrainConfig(global_batch=8, seq_len=16)  # 128 tokens a step
    phases = [MixturePhase("main", 0, [1.0, 0.0]), MixturePhase("anneal", 512, [0.0, 1.0])]
    sampler = MixtureSampler([50, 50], [1, 1], 8, seed=0, ramp=Ramp(train), phases=phases)
    counts = [np.bincount(sampler.global_batch_pairs(k)[0], minlength=2).tolist() for k in range(6)]
    assert counts == [[8, 0]] * 4 + [[0, 8]] * 2


def test_a_ramp_s_steps_cut_the_same_stream_of_sequences_into_pieces() -> None:
    # Steps of 2 x 8 tokens read one 16-token sequence of the data order, cut in two.
    ramp = Ramp(RAMP)
    sampler = MixtureSampler([40, 30, 20], [1, 1, 1], 8, seed=3, ramp=ramp, phases=PHASES)
    for step in range(30):
        units_src, units = sampler.global_batch_pairs(step)
        sources, pieces = sampler.step_pairs(step)
        r = ramp.phase(step).pieces
        assert len(sources) == ramp.phase(step).global_batch == len(units) * r
        assert np.array_equal(pieces // r, np.repeat(units, r))
        assert np.array_equal(pieces % r, np.tile(np.arange(r), len(units)))
        assert np.array_equal(sources, np.repeat(units_src, r))


def test_every_layout_and_a_resumed_sampler_see_the_same_ramp_steps() -> None:
    def pairs(dp_size: int, micro_batch: int, step: int) -> list[tuple[int, int]]:
        sampler = MixtureSampler(
            [40, 30, 20], [1, 1, 1], 8, seed=3, ramp=Ramp(RAMP), phases=PHASES
        )  # a fresh sampler: what a run resumed at `step` builds
        return sorted(
            (int(s), int(i))
            for rank in range(dp_size)
            for sources, indices in sampler.rank_micro_batches(step, rank, dp_size, micro_batch)
            for s, i in zip(sources, indices, strict=True)
        )

    for step in (0, 7, 12, 25):
        assert pairs(2, 1, step) == pairs(1, 2, step)
