"""Fixtures shared by the distributed tests: a work dir per test module and the one
single-process reference run of the harness model that several layouts compare against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import Curve, run_pretrain


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory for this test module's run dirs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="session")
def harness_reference(tmp_path_factory: pytest.TempPathFactory) -> Curve:
    """The harness model trained by one process: the curve every FP32 layout must match."""
    return run_pretrain(tmp_path_factory.mktemp("reference") / "run", [], nproc=1)
