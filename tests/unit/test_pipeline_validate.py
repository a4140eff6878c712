"""Which pipeline layouts the trainer runs, and the messages for the ones it refuses."""

import pytest

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.stages import rank_stages, stage_layers
from pretrain.launcher.plan.memory import memory_breakdown, stage_params
from pretrain.launcher.plan.plan import make_plan
from pretrain.launcher.validate.recipe import check_runnable, validate
from pretrain.models.flops import count_params
from tests.helpers import configure, problems


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "parallel.zero": 3},
        {
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.zero": 2,
        },
        {
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.pp_schedule": "zero_bubble",
            "parallel.zero": 2,
        },
        {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.zero": 3},
        {"parallel.pp": 2, "parallel.pp_layers": [3, 5], "parallel.zero": 2},
    ],
)
def test_pipeline_layouts_are_runnable(overrides):
    cfg = configure(overrides)
    validate(cfg, for_launch=True)
    assert check_runnable(cfg) == []


@pytest.mark.parametrize(
    ("pp_layers", "vpp"), [([4, 4, 1], 1), ([0, 8], 1), ([3, 4], 1), ([2, 2, 2, 1], 2)]
)
def test_pp_layers_must_give_every_stage_layers_summing_to_the_model(pp_layers, vpp):
    schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    cfg = configure(
        {
            "parallel.pp": 2,
            "parallel.vpp": vpp,
            "parallel.pp_schedule": schedule,
            "parallel.pp_layers": pp_layers,
        }
    )
    [problem] = [p for p in problems(cfg) if p.field == "parallel.pp_layers"]
    stages = 2 * vpp
    assert f"needs pp*vpp = {stages} positive layer counts summing to model.n_layers=8" in (
        problem.reason
    )
    assert "e.g. [" + ",".join([str(8 // stages)] * stages) + "]" in problem.fix


def test_uneven_layers_without_pp_layers_point_to_a_split_with_lighter_ends():
    [problem] = [p for p in problems(configure({"parallel.pp": 3})) if p.field == "parallel.pp"]
    assert "parallel.pp_layers=[3,3,2]" in problem.fix


def test_tied_embeddings_are_accepted_across_stages():
    # The last stage keeps a copy of the embedding whose gradient is summed with the first's.
    validate(configure({"parallel.pp": 2, "parallel.zero": 2, "model.tie_embeddings": True}))


def test_pp_microbatches_must_split_the_rank_batch_evenly():
    cfg = configure({"parallel.pp": 2})
    sequences = cfg.train.micro_batch * grad_accum_steps(cfg)
    odd = next(n for n in range(2, sequences) if sequences % n)
    cfg = configure({"parallel.pp": 2, "parallel.pp_microbatches": odd})
    [problem] = problems(cfg)
    assert problem.field == "parallel.pp_microbatches"
    assert f"do not split into {odd} equal micro-batches" in problem.reason


def test_stage_layers_are_contiguous_and_ranks_hold_looped_chunks():
    assert stage_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(8, 2, 1, [3, 5]) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert rank_stages(0, 2, 2) == [0, 2]
    assert rank_stages(1, 2, 2) == [1, 3]


def test_memory_model_counts_the_first_ranks_layers_of_an_uneven_split():
    even = configure({"parallel.pp": 2})
    light_first = configure({"parallel.pp": 2, "parallel.pp_layers": [2, 6]})
    degrees = resolve_degrees(even)
    assert (
        memory_breakdown(light_first, degrees, 8).total < memory_breakdown(even, degrees, 8).total
    )


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_run_with_two_chunks_per_rank(schedule):
    cfg = configure(
        {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": schedule, "parallel.zero": 2}
    )
    validate(cfg, for_launch=True)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_need_vpp_2(schedule):
    cfg = configure({"parallel.pp": 2, "parallel.pp_schedule": schedule})
    [problem] = problems(cfg)
    assert problem.field == "parallel.vpp"
    assert "exactly two chunks on each rank, in a V" in problem.reason
    assert problem.fix == "set parallel.vpp=2"


def test_dualpipev_needs_as_many_micro_batches_as_stages():
    cfg = configure(
        {
            "parallel.pp": 4,
            "parallel.vpp": 2,
            "parallel.pp_schedule": "dualpipev",
            "parallel.pp_microbatches": 4,
        }
    )
    [problem] = problems(cfg)
    assert problem.field == "parallel.pp_microbatches"
    assert "as many micro-batches as stages (2pp = 8)" in problem.reason
    assert "parallel.pp_microbatches >= 8" in problem.fix


def test_2bw_needs_a_pipeline_and_one_chunk_per_rank():
    [problem] = problems(configure({"parallel.pp_schedule": "2bw"}))
    assert (problem.field, problem.value) == ("parallel.pp_schedule", "2bw")
    assert "with pp=1 there is no pipeline" in problem.reason
    cfg = configure({"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "2bw"})
    [problem] = problems(cfg)
    assert problem.field == "parallel.vpp"


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallel.pp_schedule": "2bw"},
        {"parallel.pp_schedule": "zbv", "parallel.vpp": 2},
        {"parallel.pp_schedule": "dualpipev", "parallel.vpp": 2},
    ],
)
def test_every_schedule_evaluates_masks_documents_chunks_the_loss_and_ties_embeddings(
    overrides,
):
    features = {
        "eval.every": 4,
        "data.val_fraction": 0.01,
        "data.doc_mask": True,
        "train.loss_chunks": 2,
        "model.tie_embeddings": True,
    }
    cfg = configure({"parallel.pp": 2, "parallel.zero": 2, **features, **overrides})
    validate(cfg, for_launch=True)
    assert check_runnable(cfg) == []


def test_a_tied_head_under_a_v_schedule_sits_beside_the_embedding_on_rank_0():
    cfg = configure(
        {
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.pp_schedule": "zbv",
            "model.tie_embeddings": True,
        }
    )
    validate(cfg)
    counts = count_params(cfg.model)
    embedding_and_copy = 2 * counts.embedding + counts.final_norm
    assert stage_params(cfg, 0)[1] == embedding_and_copy
    assert stage_params(cfg, 1)[1] == 0


@pytest.mark.parametrize(("schedule", "vpp"), [("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2)])
def test_split_backward_schedules_run_compiled_blocks_and_cost_their_second_backward(schedule, vpp):
    """A compiled block's backward is one node: the input and the weight pass each run it
    (parallel/compile.py), which the plan says and adds to the compute."""
    fields = {"parallel.pp": 2, "parallel.vpp": vpp, "parallel.pp_schedule": schedule}
    compiled = configure({**fields, "compile.enabled": True})
    validate(compiled, for_launch=True)
    plan = make_plan(compiled)
    [warning] = [w for w in plan.warnings if w.startswith("compile.blocks=true")]
    assert "each run all of it" in warning
    eager = make_plan(configure({**fields, "compile.enabled": True, "compile.blocks": False}))
    assert plan.step_cost.compute > 1.2 * eager.step_cost.compute


@pytest.mark.parametrize(("schedule", "vpp"), [("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2)])
def test_split_backward_schedules_refuse_selective_recompute_for_launch(schedule, vpp):
    """It was accepted and failed (found by the pairwise matrix). ZeRO-3, which trained
    wrongly there, runs since the stage gathers its weights before both backward passes
    (parallel/pipeline/split_backward.py)."""
    layout = {"parallel.pp": 2, "parallel.vpp": vpp, "parallel.pp_schedule": schedule}
    cfg = configure({**layout, "parallel.zero": 2, "recompute.policy": "selective"})
    validate(cfg)  # the layout can still be planned
    [problem] = problems(cfg, for_launch=True)
    assert problem.field == "recompute.policy" and "one backward only" in problem.reason
    assert "recompute.policy=full or none" in problem.fix
    validate(configure({**layout, "parallel.zero": 3}), for_launch=True)
