"""The plan of a ramp: each phase at its own batch and seq_len, the plan's own figures at the
last and largest stage; and the mixture schedule's phases with their first steps."""

from __future__ import annotations

import pytest

from pretrain.launcher.plan.plan import make_plan, plan_to_dict
from pretrain.launcher.plan.report.render import render_plan, render_summary
from tests.helpers import compose_recipe

RAMP = [
    "train.batch_schedule=[{global_batch:64,until_tokens:4000000000},"
    "{global_batch:128,until_tokens:12000000000}]",
    "train.seq_len_schedule=[{seq_len:2048,until_tokens:2000000000}]",
]


@pytest.fixture(scope="module")
def plan():
    return make_plan(compose_recipe("llama3_8b", RAMP))


def test_each_phase_is_planned_at_its_batch_and_seq_len(plan) -> None:
    shape = [(p.global_batch, p.seq_len, p.grad_accum) for p in plan.phases]
    assert shape == [(64, 2048, 16), (64, 8192, 16), (128, 8192, 32), (256, 8192, 64)]
    # Steps of 64 x 2048 tokens until 2B: 15,259 of them; the last phase ends the run.
    assert [(p.first_step, p.last_step) for p in plan.phases][:2] == [(1, 15259), (15260, 19074)]
    assert plan.phases[-1].last_step == 50000
    assert plan.phases[1].tokens_before == 15259 * 64 * 2048
    times = [p.step_time_s for p in plan.phases]
    assert times == sorted(times) and times[-1] == pytest.approx(plan.step_time_s)
    assert plan.phases[-1].mfu == pytest.approx(plan.mfu)
    # Memory at the largest stage is the plan's: no phase needs more.
    assert max(p.memory_gib for p in plan.phases) == pytest.approx(plan.memory.total_gib)
    assert plan.phases[0].memory_gib < plan.memory.total_gib


def test_the_plan_prints_every_phase_and_its_json_holds_them(plan) -> None:
    text = render_plan(plan)
    assert "Phases (train.batch_schedule, train.seq_len_schedule; LR by tokens)" in text
    assert "15260-19074" in text and "128 x 8192" in text
    assert "ramp (steps batch x seq_len): 1-15259 64x2048, 15260-19074 64x8192" in (
        render_summary(plan)
    )
    assert [p["global_batch"] for p in plan_to_dict(plan)["phases"]] == [64, 64, 128, 256]


def test_the_plan_shows_where_each_mixture_phase_begins() -> None:
    cfg = compose_recipe(
        "tiny",
        [
            "data.sources=[{source:stdlib,name:web},{source:stdlib,name:hq}]",
            "data.mixture_schedule=[{weights:[3,1]},{name:anneal,from_tokens:76800,weights:[1,3]}]",
        ],
    )
    plan = make_plan(cfg)
    # 16 x 128 = 2,048 tokens a step: step 39 is the first to start at or past 76,800 (with
    # 77,824 trained before it); the anneal begins there.
    assert [(p.name, p.first_step, p.shares) for p in plan.mixture_phases] == [
        ("phase 0", 1, {"web": 0.75, "hq": 0.25}),
        ("anneal", 39, {"web": 0.25, "hq": 0.75}),
    ]
    assert "Mixture phases (data.mixture_schedule)" in render_plan(plan)
