"""The V-shaped schedules (ZB-V, DualPipeV) reproduce the single-process curves.

FP32 on CPU, within the harness's tolerances (`assert_same_curve`: loss, gradient norm and
the validation loss, which runs forward only outside torch's schedule). vpp=2 chunks per
rank placed in a V (rank r holds stages r and 2pp-1-r, so rank 0 runs both the embedding and
the loss). pp=2 splits the harness's 4 layers into 4 stages; DualPipeV there masks attention
to documents (on a corpus of short ones, `doc_mask_overrides`), which every stage's
attention must receive. pp=4 needs 8 stages, so its reference has 8 layers, and
micro-batches of one sequence, which give DualPipeV the 2pp = 8 micro-batches it needs per
step without re-splitting the reference's micro-batches (4 steps: 4 ranks cost the most).
ZB-V at pp=2 also trains with compiled blocks, whose one backward node both the input and
the weight pass run (parallel/compile.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import Layout, TrainedTogether, assert_same_curve, train_together

pytestmark = pytest.mark.distributed

PP4_MODEL = ["model.n_layers=8", "train.micro_batch=1", "train.steps=4"]


@pytest.fixture(scope="module")
def models(doc_mask_overrides: list[str]) -> dict[str, list[str]]:
    """The overrides of each reference's model and data."""
    return {"harness": [], "doc_mask": doc_mask_overrides, "pp4_model": PP4_MODEL}


COMPILED = ("compile.enabled=true", "compile.backend=aot_eager")
CASES = [
    ("zbv", 2, "harness", ()),
    ("zbv", 2, "harness", COMPILED),
    ("dualpipev", 2, "doc_mask", ()),
    ("zbv", 4, "pp4_model", ()),
    ("dualpipev", 4, "pp4_model", ()),
]
"""Each V schedule's pipeline ranks, reference and further overrides."""


def label(schedule: str, pp: int, extra: tuple[str, ...]) -> str:
    return f"{schedule}_pp{pp}" + ("_compiled" if extra else "")


@pytest.fixture(scope="module")
def trained(workdir: Path, models: dict[str, list[str]]) -> TrainedTogether:
    """The layouts and the pp=4 model's reference, those of one world size in one launch."""
    layouts = {"reference_pp4_model": Layout(tuple(PP4_MODEL), 1)}
    for schedule, pp, reference, extra in CASES:
        overrides = [
            *models[reference], f"parallel.pp={pp}", "parallel.vpp=2",
            f"parallel.pp_schedule={schedule}", *extra,
        ]  # fmt: skip
        layouts[label(schedule, pp, extra)] = Layout(tuple(overrides), pp)
    return train_together(workdir, layouts)


@pytest.fixture(scope="module")
def references(trained, harness_reference, doc_mask_reference) -> dict:
    return {
        "harness": harness_reference,
        "doc_mask": doc_mask_reference,
        "pp4_model": trained.curve("reference_pp4_model"),
    }


@pytest.mark.parametrize(
    ("schedule", "pp", "reference", "extra"), CASES, ids=[label(c[0], c[1], c[3]) for c in CASES]
)
def test_v_schedule_matches_reference(
    trained, references, grad_norm_tolerance, schedule, pp, reference, extra
) -> None:
    curve = trained.curve(label(schedule, pp, extra))
    assert_same_curve(curve, references[reference], grad_norm_tolerance)
