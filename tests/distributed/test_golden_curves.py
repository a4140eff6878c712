"""The shipped tiny recipes still train to their committed golden curves.

Each case (tests/golden/cases.py) runs 20 FP32 steps through the CLI on the corpus kept in
tests/golden (the same text on every Python) and must match its JSON file step by step,
within `LOSS_TOLERANCE` (loss) and `GRAD_NORM_TOLERANCE` (gradient norm).
A change that moves a curve on purpose regenerates the files
(`python -m tests.golden.regenerate`) and says why.
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import max_relative_difference
from tests.golden.cases import (
    CASES,
    GRAD_NORM_TOLERANCE,
    LOSS_TOLERANCE,
    GoldenCase,
    corpus_identity,
    read_golden,
    run_case,
)

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recipe_reproduces_golden_curve(workdir, case: GoldenCase) -> None:
    golden, made_with = read_golden(case)
    assert made_with == corpus_identity(), "the corpus changed: regenerate the golden curves"
    curve = run_case(case, workdir / case.name)
    assert len(curve.loss) == len(golden.loss) == 20
    assert max_relative_difference(curve.loss, golden.loss) <= LOSS_TOLERANCE
    assert max_relative_difference(curve.grad_norm, golden.grad_norm) <= GRAD_NORM_TOLERANCE
