"""Fixtures shared by the distributed tests: a work dir per test module and the single-process
reference runs of the harness model with experts, with document masks (on a corpus of short
documents) and with MLA that the MoE, document-masked and MLA layouts compare against (the
dense one, `harness_reference`, is in tests/conftest.py: the SLURM jobs match it too)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from tests.distributed.harness import MLA, Curve, read_curve, trained_once
from tests.golden.cases import CORPUS
from tests.helpers import made_once


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory for this test module's run dirs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


MOE_REFERENCE = ["model.moe_ffn_dim=64"]
"""The tiny_moe recipe on the harness model: first layer dense, then 8 experts of width 64."""


@pytest.fixture(scope="session")
def moe_reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the harness model with tiny_moe's experts trained by one process."""
    return trained_once(tmp_path_factory, "moe_reference", MOE_REFERENCE, recipe="tiny_moe")


@pytest.fixture(scope="session")
def moe_reference(moe_reference_run: Path) -> Curve:
    """The curve of `moe_reference_run`: what every FP32 MoE layout must match."""
    return read_curve(moe_reference_run / "metrics.jsonl")


@pytest.fixture(scope="session")
def doc_mask_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Document-aware attention on a corpus of short documents: the golden corpus's source
    files cut at their blank lines (paragraphs of 120 bytes at the median), so nearly every
    sequence of the harness's 64 tokens spans a document boundary. On the harness's own
    corpus (a dozen long files) a few steps see almost none, and a masked run trains exactly
    as an unmasked one."""

    def cut(path: Path) -> None:
        with lzma.open(CORPUS, "rt", encoding="utf-8") as corpus, path.open("w") as out:
            for line in corpus:
                for paragraph in json.loads(line)["text"].split("\n\n"):
                    if paragraph.strip():
                        out.write(json.dumps({"text": paragraph}) + "\n")

    # One file for every worker: the prepared dataset is keyed by the file, so all share it.
    path = made_once(tmp_path_factory, "paragraphs.jsonl", cut)
    return ["data.doc_mask=true", f"data.source={path}"]


@pytest.fixture(scope="session")
def doc_mask_reference(tmp_path_factory: pytest.TempPathFactory, doc_mask_overrides) -> Curve:
    """The harness model with `doc_mask_overrides` trained by one process: what every
    layout with document masks must match."""
    run_dir = trained_once(tmp_path_factory, "doc_mask_reference", doc_mask_overrides)
    return read_curve(run_dir / "metrics.jsonl")


@pytest.fixture(scope="session")
def mla_reference(tmp_path_factory: pytest.TempPathFactory) -> Curve:
    """The harness model under MLA trained by one process (tensor and context parallelism
    match it)."""
    run_dir = trained_once(tmp_path_factory, "mla_reference", list(MLA))
    return read_curve(run_dir / "metrics.jsonl")
