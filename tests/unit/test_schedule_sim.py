"""The simulated pipeline schedules reproduce the known results of the literature."""

from __future__ import annotations

import itertools

import pytest

from pretrain.launcher.plan.memory import in_flight
from pretrain.launcher.plan.pipeline.schedule_sim import (
    IDLE,
    bubble_fraction,
    program,
    simulate,
    summary,
)

P, M = 4, 8


def unit(schedule: str, vpp: int = 1):
    """Unit forward and backward times: an unsplit backward costs b + w = 1."""
    return simulate(schedule, P, M, vpp, f=1, b=1, w=0)


def test_gpipe_and_1f1b_idle_equally_on_every_stage() -> None:
    gpipe, one_f_one_b = unit("gpipe"), unit("1f1b")
    for rank in range(P):
        idle_gpipe = gpipe.makespan - gpipe.busy(rank)
        idle_1f1b = one_f_one_b.makespan - one_f_one_b.busy(rank)
        assert idle_gpipe == idle_1f1b == 2 * (P - 1)


def test_1f1b_stage0_holds_p_microbatches_where_gpipe_holds_m() -> None:
    assert unit("1f1b").peak_in_flight(0) == P
    assert unit("gpipe").peak_in_flight(0) == M


def test_1f1b_stage_s_holds_p_minus_s() -> None:
    timeline = unit("1f1b")
    assert [timeline.peak_in_flight(r) for r in range(P)] == [P - r for r in range(P)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4, 8, 32])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule: str, m: int) -> None:
    for f, b in ((1, 1), (1, 2)):  # independent of the backward/forward ratio
        timeline = simulate(schedule, P, m, f=f, b=b, w=0)
        assert timeline.bubble_fraction == pytest.approx((P - 1) / (m + P - 1))
        assert timeline.bubble_fraction == pytest.approx(bubble_fraction(schedule, P, m))


@pytest.mark.parametrize("vpp", [2, 4])
def test_interleaving_divides_the_bubble_by_about_v(vpp: int) -> None:
    plain, interleaved = unit("1f1b").bubble_fraction, unit("interleaved_1f1b", vpp)
    # Exactly (p-1)/v idle chunks' time over m + (p-1)/v: the plan's formula divides by v.
    assert interleaved.bubble_fraction == pytest.approx((P - 1) / vpp / (M + (P - 1) / vpp))
    assert plain / vpp < interleaved.bubble_fraction < plain / vpp * 1.5


@pytest.mark.parametrize("vpp", [2, 4])
def test_interleaved_stage0_holds_what_the_memory_model_assumes(vpp: int) -> None:
    timeline = unit("interleaved_1f1b", vpp)
    # Stage-sized micro-batches: p + (p - 1) / v (Narayanan et al. 2021).
    assert timeline.peak_in_flight(0) == pytest.approx(P + (P - 1) / vpp)
    assert timeline.peak_in_flight(0) == pytest.approx(in_flight("interleaved_1f1b", P, M, vpp))


def test_zero_bubble_fills_bubbles_with_weight_gradients_and_holds_p_on_every_rank() -> None:
    """ZB1P as torch's ScheduleInterleavedZeroBubble orders it: rank r defers its weight
    gradients for r steady steps, so every rank holds p micro-batches (1F1B's rank 0)."""
    split = simulate("zero_bubble", P, M, f=1, b=1, w=1)
    unsplit = simulate("1f1b", P, M, f=1, b=1, w=1)
    assert split.bubble_fraction < unsplit.bubble_fraction
    assert [split.peak_in_flight(r) for r in range(P)] == [P] * P
    assert [in_flight("zero_bubble", P, M, 1, r) for r in range(P)] == [P] * P
    # The last stage never waits once its first forward has run.
    last = split.rows[-1]
    assert all(a.end == b.start for a, b in itertools.pairwise(last))


def test_interleaved_zero_bubble_at_p4_m8_v2_holds_4_on_every_rank_after_8_forwards() -> None:
    """Hand-derived from torch's ZB1P order (schedules.py, ScheduleInterleavedZeroBubble):
    rank 0 warms up with (v-1)p + (p-1) = 7 forwards and runs its 8th before its first B;
    its W follows each B at once, so it holds 8 chunk-micro-batches = 4 stages, as do the
    other ranks (the former simulator said [5.5, 4.5, 3.5, 2.5] and 11 forwards)."""
    report = summary("zero_bubble", 4, 8, 2)
    assert report["peak_in_flight_per_stage"] == [4, 4, 4, 4]
    assert [in_flight("zero_bubble", 4, 8, 2, r) for r in range(4)] == [4, 4, 4, 4]
    kinds = [op.kind for op in program("zero_bubble", 4, 8, 0, 2)]
    assert kinds.index("B") == 8


def test_the_interleaved_bubble_is_x_over_1_plus_x_with_x_p_minus_1_over_v_m() -> None:
    """At p=16, m=16, v=2: x = 15/32, so the bubble is 15/47 = 31.9% of the step (the
    former closed form ((p-1)/v)/(m+p-1) said 24.2%); the simulated chart agrees."""
    assert bubble_fraction("interleaved_1f1b", 16, 16, 2) == pytest.approx(15 / 47)
    assert f"{bubble_fraction('interleaved_1f1b', 16, 16, 2):.1%}" == "31.9%"
    simulated = simulate("interleaved_1f1b", 16, 16, 2, f=1, b=1, w=0).bubble_fraction
    assert simulated == pytest.approx(15 / 47)


@pytest.mark.parametrize(
    ("schedule", "vpp"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]
)
def test_every_op_runs_once_and_after_its_inputs(schedule: str, vpp: int) -> None:
    timeline = simulate(schedule, P, M, vpp)
    ends: dict[tuple[str, int, int], float] = {}
    for rank, row in enumerate(timeline.rows):
        for slot in row:
            key = (slot.op.kind, slot.op.chunk * P + rank, slot.op.microbatch)
            assert key not in ends
            ends[key] = slot.end
    kinds = 3 if schedule == "zero_bubble" else 2
    assert len(ends) == kinds * P * vpp * M
    for rank, row in enumerate(timeline.rows):
        for slot in row:
            stage, mb = slot.op.chunk * P + rank, slot.op.microbatch
            if slot.op.kind == "F" and stage > 0:
                assert ends[("F", stage - 1, mb)] <= slot.start
            if slot.op.kind == "B" and stage < P * vpp - 1:
                assert ends[("B", stage + 1, mb)] <= slot.start


def test_chart_has_a_row_per_stage_and_a_cell_per_time_slot() -> None:
    timeline = simulate("1f1b", P, M)
    rows = timeline.chart().splitlines()
    assert len(rows) == P
    cells = rows[0].split("| ")[1].split(" ")
    assert len([c for c in cells if c]) == timeline.makespan
    assert rows[0].split("| ")[1].startswith("F0 F1 F2 F3 " + IDLE)


def test_summary_charts_at_most_2p_microbatches_but_measures_all() -> None:
    report = summary("1f1b", P, 128)
    assert report["charted_microbatches"] == 2 * P
    assert report["chart"] == simulate("1f1b", P, 2 * P).chart()
    assert report["bubble_fraction"] == pytest.approx((P - 1) / (128 + P - 1))
