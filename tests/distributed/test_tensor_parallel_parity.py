"""Tensor and sequence parallelism reproduce the single-process loss and gradient norm.

FP32 on CPU, within the harness's tolerances, as for data parallelism. TP=2 runs against
the harness's model; TP=4 replicates its 2 key/value heads (each shared by the query heads
of 2 ranks: a weight gradient not summed over tp, or an input gradient reduced twice, moves
the first step's gradient norm), and it also pads a vocabulary of 510 to 512 with a tied
LM head: padded logits that leaked into the softmax would raise the very first loss by
about log(512/510) = 4e-3. Document-aware
attention (data.doc_mask, on a corpus of short documents: `doc_mask_overrides`) under TP + SP
matches its own one-process run. Multi-head latent
attention (with a query latent) splits its heads over tp and keeps its latent projections
replicated: a rotary key gradient not summed over tp moved the gradient norm by 1.4%. A
GeLU MLP (no up projection) splits its two matrices as SwiGLU's.
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

TP4_MODEL = ["model.vocab_size=510", "model.tie_embeddings=true"]
GELU = ["model.mlp=gelu"]


LAYOUTS = {
    "tp2": ("harness", ["parallel.tp=2"], 2),
    "tp2_sp": ("harness", ["parallel.tp=2", "parallel.sp=true"], 2),
    "tp2_sp_doc_mask": ("doc_mask", ["parallel.tp=2", "parallel.sp=true"], 2),
    "tp4_padded_vocab": ("tp4_model", [*TP4_MODEL, "parallel.tp=4"], 4),
    "tp4_sp_padded_vocab": ("tp4_model", [*TP4_MODEL, "parallel.tp=4", "parallel.sp=true"], 4),
    # DDP over TP's DTensor weights runs on FSDP2's replicate (ZeRO-3 with tp: the 3-D and
    # context-parallel tests).
    "tp2_dp2_ddp": ("harness", ["parallel.tp=2", "parallel.zero=0"], 4),
    "tp2_full_recompute": ("harness", ["parallel.tp=2", "recompute=full"], 2),
    "mla_tp2_sp": ("mla", [*MLA, "parallel.tp=2", "parallel.sp=true"], 2),
    "gelu_tp2_sp": ("gelu", [*GELU, "parallel.tp=2", "parallel.sp=true"], 2),
    "tp2_sp_selective_recompute": (
        "harness",
        ["parallel.tp=2", "parallel.sp=true", "recompute=selective"],
        2,
    ),
}
"""Each layout's reference and overrides and its ranks."""
OWN_REFERENCES = {"tp4_model": TP4_MODEL, "gelu": GELU}
"""References of this module's own, trained beside its layouts."""


@pytest.fixture(scope="module")
def trained(workdir: Path, doc_mask_overrides: list[str]) -> TrainedTogether:
    """The layouts and this module's references, the runs of one world size in one launch."""
    layouts = {
        f"reference_{name}": Layout(tuple(overrides), 1)
        for name, overrides in OWN_REFERENCES.items()
    }
    for label, (reference, overrides, nproc) in LAYOUTS.items():
        data = doc_mask_overrides if reference == "doc_mask" else []
        layouts[label] = Layout((*data, *overrides), nproc)
    return train_together(workdir, layouts)


@pytest.fixture(scope="module")
def references(trained, harness_reference, doc_mask_reference, mla_reference) -> dict:
    return {
        "harness": harness_reference,
        "doc_mask": doc_mask_reference,
        "mla": mla_reference,
        **{name: trained.curve(f"reference_{name}") for name in OWN_REFERENCES},
    }


@pytest.mark.parametrize("label", LAYOUTS)
def test_tensor_parallel_layout_matches_reference(
    trained, references, grad_norm_tolerance, label
) -> None:
    reference = LAYOUTS[label][0]
    assert_same_curve(trained.curve(label), references[reference], grad_norm_tolerance)
