"""Fixtures shared by the distributed tests: a work dir per test module and the single-process
reference runs of the harness model with experts that the MoE layouts compare against, with
document masks and with MLA (the dense one, `harness_reference`, is in tests/conftest.py: the SLURM
jobs match it too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import DOC_MASK, MLA, Curve, read_curve, run_pretrain


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory for this test module's run dirs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


MOE_REFERENCE = ["model.moe_ffn_dim=64"]
"""The tiny_moe recipe on the harness model: first layer dense, then 8 experts of width 64."""


@pytest.fixture(scope="session")
def moe_reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the harness model with tiny_moe's experts trained by one process."""
    run_dir = tmp_path_factory.mktemp("moe_reference") / "run"
    run_pretrain(run_dir, MOE_REFERENCE, nproc=1, recipe="tiny_moe")
    return run_dir


@pytest.fixture(scope="session")
def moe_reference(moe_reference_run: Path) -> Curve:
    """The curve of `moe_reference_run`: what every FP32 MoE layout must match."""
    return read_curve(moe_reference_run / "metrics.jsonl")


@pytest.fixture(scope="session")
def doc_mask_reference(tmp_path_factory: pytest.TempPathFactory) -> Curve:
    """The harness model under DOC_MASK trained by one process (tensor and context
    parallelism match it)."""
    return run_pretrain(
        tmp_path_factory.mktemp("doc_mask_reference") / "run", list(DOC_MASK), nproc=1
    )


@pytest.fixture(scope="session")
def mla_reference(tmp_path_factory: pytest.TempPathFactory) -> Curve:
    """The harness model under MLA trained by one process (tensor and context parallelism
    match it)."""
    return run_pretrain(tmp_path_factory.mktemp("mla_reference") / "run", list(MLA), nproc=1)
