"""The simulator's programs are the schedule IR torch runs: for every looped-placement
schedule the trainer accepts, at every (pp, vpp, micro-batches) shape validation lets
through, each rank's order of F, B and W ops equals the `pipeline_order` of the
`torch.distributed.pipelining` class `parallel/pipeline/stages.py` builds, and the memory model's
in-flight count is the one that order implies.

The torch classes are built over stand-in stages (their constructors read only the stage
index, counts and group rank) so no process group is needed; the plan itself never imports
torch. The V schedules, whose chunks are placed in a V and whose DualPipeV overlaps a
forward with a backward in one action, are compared with torch's order in
`tests/unit/test_schedule_v.py`; 2bw is an in-repo schedule (`tests/unit/test_pipedream.py`).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.distributed.pipelining.schedules import _ComputationType

from pretrain.core.problems import RecipeError
from pretrain.launcher.plan.memory import in_flight
from pretrain.launcher.plan.pipeline.schedule_sim import SCHEDULES, SIMULATED, program
from pretrain.launcher.validate.recipe import validate
from pretrain.parallel.pipeline.stages import MULTI_STAGE, schedule_classes
from tests.helpers import configure

KINDS = {
    _ComputationType.FORWARD: "F",
    _ComputationType.FULL_BACKWARD: "B",
    _ComputationType.BACKWARD_INPUT: "B",
    _ComputationType.BACKWARD_WEIGHT: "W",
}
PPS, VPPS = (2, 3, 4, 8), (1, 2, 3, 4)
LOOPED = tuple(s for s in SCHEDULES if s not in SIMULATED)
"""The schedules torch runs over the looped placement (stages r, r + pp, ...)."""


class StandInStage:
    """What a schedule's constructor reads from a `PipelineStage`."""

    def __init__(self, index: int, stages: int, pp: int) -> None:
        self.stage_index, self.num_stages = index, stages
        self.group_size, self.group_rank = pp, index % pp
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Identity()


def accepted(schedule: str, pp: int, vpp: int, microbatches: int) -> bool:
    """Whether validation lets the trainer run this shape (one rank per stage, dp=1)."""
    cfg = configure(
        {
            "model.n_layers": 96,
            "parallel.pp": pp,
            "parallel.vpp": vpp,
            "parallel.pp_schedule": schedule,
            "cluster.gpus_per_node": pp,
            "train.micro_batch": 1,
            "train.global_batch": microbatches,
        }
    )
    try:
        validate(cfg)
    except RecipeError:
        return False
    return True


SHAPES = [
    (schedule, pp, vpp, m)
    for schedule, pp, vpp in itertools.product(LOOPED, PPS, VPPS)
    for m in range(1, 3 * pp + 1)
    if accepted(schedule, pp, vpp, m)
]


@functools.cache
def torch_order(schedule: str, pp: int, vpp: int, m: int) -> dict[int, list[tuple]]:
    """(kind, micro-batch, chunk) of each rank's compute actions in torch's schedule IR."""
    cls = schedule_classes()[schedule]
    if schedule in MULTI_STAGE:
        built = cls([StandInStage(c * pp, pp * vpp, pp) for c in range(vpp)], n_microbatches=m)
    else:
        built = cls(StandInStage(0, pp, pp), n_microbatches=m)
    return {
        rank: [
            (KINDS[a.computation_type], a.microbatch_index, a.stage_index // pp)
            for a in actions
            if a is not None and a.computation_type in KINDS
        ]
        for rank, actions in built.pipeline_order.items()
    }


def test_the_shapes_cover_every_schedule_and_the_rules_refuse_some() -> None:
    assert {s for s, *_ in SHAPES} == set(LOOPED)
    # Torch's multi-stage classes split m into max(1, m // p) equal rounds: p=4, m=9 cannot.
    assert not accepted("interleaved_1f1b", 4, 1, 9) and accepted("1f1b", 4, 1, 9)
    assert not accepted("zero_bubble", 4, 2, 6)  # vpp > 1 needs a multiple of pp
    assert len(SHAPES) > 150


@pytest.mark.parametrize("schedule", LOOPED)
def test_every_rank_runs_torchs_order(schedule: str) -> None:
    for name, pp, vpp, m in SHAPES:
        if name != schedule:
            continue
        expected = torch_order(schedule, pp, vpp, m)
        for rank in range(pp):
            ops = program(schedule, pp, m, rank, vpp)
            ours = [(op.kind, op.microbatch, op.chunk) for op in ops]
            theirs = expected[rank]
            if schedule == "1f1b" and rank == pp - 1:
                # Schedule1F1B's IR numbers the last rank's forwards from 1 (its runtime,
                # `_step_microbatches`, runs micro-batches 0..m-1 in order): compare kinds,
                # backwards and the forwards' order.
                assert [k for k, *_ in ours] == [k for k, *_ in theirs], (pp, m)
                assert [o for o in ours if o[0] == "B"] == [o for o in theirs if o[0] == "B"]
                forwards = [mb for k, mb, _ in theirs if k == "F"]
                assert forwards == sorted(forwards) and len(set(forwards)) == m
                continue
            assert ours == theirs, (schedule, pp, vpp, m, rank)


def test_the_memory_models_in_flight_count_is_torchs_order() -> None:
    """Per rank: most chunk-micro-batches between a forward and the op that frees it (the
    backward, or its W when split), in whole stages."""
    for schedule, pp, vpp, m in SHAPES:
        release = "W" if schedule == "zero_bubble" else "B"
        for rank, actions in torch_order(schedule, pp, vpp, m).items():
            held = peak = 0
            for kind, _, _ in actions:
                held += {"F": 1, release: -1}.get(kind, 0)
                peak = max(peak, held)
            assert in_flight(schedule, pp, m, vpp, rank) == peak / vpp, (schedule, pp, vpp, m)
