"""The rules of train.batch_schedule, train.seq_len_schedule and data.mixture_schedule: each
refusal names the field, the value and a fix, before any job starts."""

from __future__ import annotations

import pytest

from pretrain.core.schema import (
    BatchStage,
    MixturePhase,
    SeqLenStage,
    SourceConfig,
    dump_config,
)
from pretrain.launcher.validate.recipe import validate
from pretrain.launcher.validate.resume import frozen_changes
from pretrain.launcher.validate.schedules import fit_schedule_to_run
from tests.helpers import configure, problems

# The base recipe: dp 8 x micro_batch 2 = 16 sequences a pass, global batch 64, seq_len 256.
RAMP = {
    "train.batch_schedule": [BatchStage(16, 10**6), BatchStage(32, 4 * 10**6)],
    "train.seq_len_schedule": [SeqLenStage(64, 10**6), SeqLenStage(128, 2 * 10**6)],
}
SOURCES = [SourceConfig(source="stdlib", name="a"), SourceConfig(source="stdlib", name="b")]


def only(overrides: dict) -> str:
    """The one problem a recipe with `overrides` has, as the user reads it."""
    [problem] = problems(configure(overrides))
    return str(problem)


def test_a_ramp_and_a_mixture_schedule_that_fit_the_layout_pass() -> None:
    phases = [MixturePhase("main", 0, [0.9, 0.1], True), MixturePhase("anneal", 10**7, [0, 1])]
    validate(configure({**RAMP, "data.sources": SOURCES, "data.mixture_schedule": phases}))


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ([BatchStage(32, 10), BatchStage(16, 20)], "train.batch_schedule[1].global_batch=16: "
         "not above the one before (32)"),
        ([BatchStage(16, 20), BatchStage(32, 20)], "train.batch_schedule[1].until_tokens=20: "
         "not above the one before (20)"),
        ([BatchStage(64, 10)], "train.batch_schedule[0].global_batch=64: not below "
         "train.global_batch=64"),
        ([BatchStage(0, 10)], "train.batch_schedule[0].global_batch=0: must be >= 1"),
        ([BatchStage(24, 10)], "train.batch_schedule[0].global_batch=24: not divisible by "
         "micro_batch*dp = 2*8 = 16; use a multiple of 16"),
    ],
)  # fmt: skip
def test_a_batch_stage_is_refused_with_its_field(stages, expected: str) -> None:
    assert only({"train.batch_schedule": stages}).startswith(expected)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"train.seq_len_schedule": [SeqLenStage(96, 10)]},
         "train.seq_len_schedule[0].seq_len=96: not a divisor of train.seq_len=256 below it"),
        ({"train.seq_len_schedule": [SeqLenStage(128, 10), SeqLenStage(64, 20)]},
         "train.seq_len_schedule[1].seq_len=64: not above the one before (128)"),
        # Every rule train.seq_len passes, each stage passes: here context parallelism's.
        ({"train.seq_len_schedule": [SeqLenStage(4, 10)], "parallel.cp": 4},
         "train.seq_len_schedule[0].seq_len=4: context parallelism cuts each sequence into "
         "2cp = 8 equal chunks"),
        ({"train.seq_len_schedule": [SeqLenStage(4, 10)], "train.loss_chunks": 8},
         "train.seq_len_schedule[0].seq_len=4: at this stage train.loss_chunks=8: does not "
         "divide train.seq_len=4"),
    ],
)  # fmt: skip
def test_a_seq_len_stage_is_refused_with_its_field(overrides: dict, expected: str) -> None:
    assert only(overrides).startswith(expected)


def test_short_sequences_must_make_whole_sequences_of_the_data_order() -> None:
    # A stage of seq_len 8 cuts each sequence of 256 into 32: a batch of 8 is a quarter.
    short = {"train.seq_len_schedule": [SeqLenStage(8, 10)], "train.micro_batch": 1}
    message = only({**short, "train.batch_schedule": [BatchStage(8, 10)]})
    assert message.startswith("train.seq_len_schedule[0].seq_len=8: cuts each sequence of the "
                              "data order into 32 pieces, and a global batch of 8")  # fmt: skip


def test_pipedream_2bw_takes_no_ramp() -> None:
    layout = {"parallel.pp": 2, "parallel.pp_schedule": "2bw", "parallel.zero": 3}
    message = only({**RAMP, **layout, "train.micro_batch": 1})
    assert message.startswith("parallel.pp_schedule=2bw: 2bw keeps its pipeline full")


def test_under_a_ramp_warmup_counts_full_steps_of_tokens() -> None:
    # 100 steps of 16 x 64 tokens are 6.25 full steps of 64 x 256 tokens.
    message = only({**RAMP, "train.steps": 100, "schedule.warmup_steps": 100})
    assert message.startswith("schedule.warmup_steps=100: under the ramp the LR schedule runs "
                              "by tokens")  # fmt: skip


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        ([MixturePhase("", 0, [1.0])], "data.mixture_schedule[0].weights=[1.0]: 1 weights for "
         "2 sources"),
        ([MixturePhase("", 0, [0.0, 0.0])], "data.mixture_schedule[0].weights=[0.0, 0.0]: "
         "weights must be finite, >= 0 and not all 0"),
        ([MixturePhase("", 0, [1.0, -1.0])], "data.mixture_schedule[0].weights=[1.0, -1.0]"),
        ([MixturePhase("", 5, [1.0, 1.0])], "data.mixture_schedule[0].from_tokens=5: the first "
         "phase sets the shares from the first step on"),
        ([MixturePhase("", 0, [1.0, 1.0]), MixturePhase("", 0, [1.0, 2.0])],
         "data.mixture_schedule[1].from_tokens=0: not above the one before (0)"),
        ([MixturePhase("", 0, [1.0, 1.0], blend=True)], "data.mixture_schedule[0].blend=true: "
         "the last phase has no next phase to blend into"),
        ([MixturePhase("x", 0, [1.0, 1.0]), MixturePhase("x", 9, [1.0, 2.0])],
         "data.mixture_schedule[0].name=x: names two phases"),
    ],
)  # fmt: skip
def test_a_mixture_phase_is_refused_with_its_field(phases, expected: str) -> None:
    message = only({"data.sources": SOURCES, "data.mixture_schedule": phases})
    assert message.startswith(expected)


def test_a_mixture_schedule_needs_sources() -> None:
    message = only({"data.mixture_schedule": [MixturePhase("", 0, [1.0])]})
    assert message.startswith("data.mixture_schedule='1 phase(s)': schedules the weights of")


def test_a_short_run_under_a_ramp_fits_its_warmup_to_the_run_s_full_steps() -> None:
    cfg = configure({**RAMP, "train.steps": 100, "schedule.warmup_steps": 100})
    [warning] = fit_schedule_to_run(cfg)
    assert warning.startswith("schedule.warmup_steps=100 is longer than the run's 6 full steps")
    assert cfg.schedule.warmup_steps == 6
    validate(cfg)


def test_a_resumed_run_may_not_change_its_schedules() -> None:
    before = configure({**RAMP, "data.sources": SOURCES})
    after = configure(
        {
            "train.batch_schedule": [BatchStage(16, 2 * 10**6)],
            "train.seq_len_schedule": RAMP["train.seq_len_schedule"],
            "data.sources": SOURCES,
            "data.mixture_schedule": [MixturePhase("", 0, [1, 1])],
        }
    )
    changed = frozen_changes(dump_config(before), dump_config(after))
    assert changed == ["data.mixture_schedule", "train.batch_schedule"]
