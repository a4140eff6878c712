"""Context parallelism reproduces the single-process loss and gradient-norm curves.

FP32 on CPU, within the harness's tolerances, as for every layout. The harness's 64-token
sequences are cut into 2cp chunks (cp rank i takes chunks i and 2cp-1-i) and attention runs the
in-repo ring (`parallel/ring_attention.py`); rotary positions follow the global positions and the
cp ranks share the gradient reduction, so nothing of the run may change. Each composition
the trainer runs gets one launch: with TP/SP under ZeRO-3 (FSDP over dp_shard x cp) and
compiled blocks (the feed-forward compiled, the ring eager: `parallel/compile.py`), and
with PP under ZeRO-2 and selective recompute.

The ring computes attention as online-softmax sums over chunk pairs (the CPU's flash kernel
per pair, FP32 tiles under documents and MLA), in another order than SDPA, which the
gradient norm amplifies once the weights drift: measured on cp2 with FP32 tiles, 0 at step
1, then 5e-7, 1e-7, 4e-6, 6e-6, 4e-5, 3e-7, 1.0e-4 (the loss within 1e-6, the validation
loss 8e-8), about 5 times the reordered reference's spread on that machine (2.1e-5), within
the derived bound of 10 times it; with the flash kernel per pair, 1.4e-5 at most.

Under `data.doc_mask` each ring step masks its chunk pair by the documents' ids (counted
over the whole sequence, gathered over cp), and cp2 matches the one-process doc-mask run.
Under MLA the decompressed per-head keys (nope + rope wide) and values (narrower) travel the
ring, and cp2 matches the one-process MLA run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import (
    MLA,
    Layout,
    TrainedTogether,
    assert_same_curve,
    train_together,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def references(harness_reference, doc_mask_reference, mla_reference) -> dict:
    return {"harness": harness_reference, "doc_mask": doc_mask_reference, "mla": mla_reference}


LAYOUTS = {
    "cp2": ("harness", ["parallel.cp=2"], 2),
    # Compiled blocks under cp: the feed-forward compiles, the ring stays eager.
    "cp2_tp2_sp_zero3_compiled": (
        "harness",
        [
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.zero=3",
            "compile.enabled=true",
            "compile.backend=aot_eager",
        ],
        4,
    ),
    "cp2_pp2_zero2_selective": (
        "harness",
        ["parallel.cp=2", "parallel.pp=2", "parallel.zero=2", "recompute=selective"],
        4,
    ),
    "cp2_doc_mask": ("doc_mask", ["parallel.cp=2"], 2),
    "cp2_mla": ("mla", ["parallel.cp=2", *MLA], 2),
}
"""Each layout's reference, overrides and ranks."""


@pytest.fixture(scope="module")
def trained(workdir: Path, doc_mask_overrides: list[str]) -> TrainedTogether:
    """The layouts, those of one world size in one launch."""
    layouts = {}
    for label, (reference, overrides, nproc) in LAYOUTS.items():
        data = doc_mask_overrides if reference == "doc_mask" else []
        layouts[label] = Layout((*data, *overrides), nproc)
    return train_together(workdir, layouts)


@pytest.mark.parametrize("label", LAYOUTS)
def test_context_parallel_layout_matches_reference(
    trained, references, grad_norm_tolerance, label
) -> None:
    reference = LAYOUTS[label][0]
    assert_same_curve(trained.curve(label), references[reference], grad_norm_tolerance)
