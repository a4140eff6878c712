"""The V-shaped schedules: the simulator's op order is torch's, and what it predicts.

`launcher/plan/pipeline/schedule_v.py` rewrites torch's order functions in pure Python for the plan;
here each rank's order is compared with torch 2.13's own (`_calculate_single_rank_
operations`, which builds `pipeline_order` rank by rank) for every shape the trainer
accepts up to pp=8, so the chart and the in-flight counts are those of the schedule that
runs. Torch's overlapped forward-backward pairs (DualPipeV) count as the forward, then the
backward; its input-gradient backward is our B followed later by its W.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _ComputationType,
)

from pretrain.core.stages import rank_layer_count, rank_stages
from pretrain.launcher.plan.pipeline.schedule_sim import program, simulate
from pretrain.launcher.plan.pipeline.schedule_v import dualpipev_order, zbv_order

KIND = {
    _ComputationType.FORWARD: "F",
    _ComputationType.BACKWARD_INPUT: "B",
    _ComputationType.FULL_BACKWARD: "B",
    _ComputationType.BACKWARD_WEIGHT: "W",
}


def torch_order(schedule_class, pp: int, microbatches: int, rank: int) -> list[tuple]:
    """(kind, chunk, micro-batch) of rank `rank`'s compute actions, as torch orders them."""
    schedule = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=2 * pp)
    order = []
    for action in schedule_class._calculate_single_rank_operations(schedule, rank):
        if action is None:  # an idle slot
            continue
        for sub in action.sub_actions or (action,):
            chunk = rank_stages(rank, pp, 2, "v").index(sub.stage_index)
            order.append((KIND[sub.computation_type], chunk, sub.microbatch_index))
    return order


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zbv_order_is_torchs(pp: int) -> None:
    for m in range(pp, 4 * pp + 1):
        for rank in range(pp):
            assert zbv_order(pp, m, rank) == torch_order(ScheduleZBVZeroBubble, pp, m, rank)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_order_is_torchs(pp: int) -> None:
    for m in range(2 * pp, 4 * pp + 1):  # DualPipeV needs at least 2pp micro-batches
        for rank in range(pp):
            assert dualpipev_order(pp, m, rank) == torch_order(ScheduleDualPipeV, pp, m, rank)


def test_v_placement_puts_the_first_and_last_stage_on_rank_0() -> None:
    assert [rank_stages(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_layer_count(16, 4, 2, pp_rank=0, style="v") == 4


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_run_every_op_once_and_bubble_less_than_1f1b(schedule: str) -> None:
    pp, m = 4, 8
    timeline = simulate(schedule, pp, m, vpp=2)
    for rank in range(pp):
        ops = program(schedule, pp, m, rank, vpp=2)
        assert sorted((s.op.kind, s.op.chunk, s.op.microbatch) for s in timeline.rows[rank]) == (
            sorted((op.kind, op.chunk, op.microbatch) for op in ops)
        )
        # Every (chunk, micro-batch) has one forward and one backward.
        assert sum(op.kind == "F" for op in ops) == sum(op.kind == "B" for op in ops) == 2 * m
    assert timeline.bubble_fraction < simulate("1f1b", pp, m).bubble_fraction / 3


def test_zbv_holds_the_micro_batches_1f1b_holds_on_its_first_rank() -> None:
    """ZB-V's memory claim (Qi et al. 2024): every rank holds p stage-sized micro-batches."""
    timeline = simulate("zbv", 4, 8, vpp=2)
    assert [timeline.peak_in_flight(r) for r in range(4)] == [4.0] * 4
