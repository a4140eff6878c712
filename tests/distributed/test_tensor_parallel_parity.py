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
    assert_same_curve,
    run_pretrain,
)

pytestmark = pytest.mark.distributed

TP4_MODEL = ["model.vocab_size=510", "model.tie_embeddings=true"]
GELU = ["model.mlp=gelu"]


@pytest.fixture(scope="module")
def references(workdir: Path, harness_reference, doc_mask_reference, mla_reference) -> dict:
    return {
        "harness": harness_reference,
        "doc_mask": doc_mask_reference,
        "tp4_model": run_pretrain(workdir / "reference_tp4_model", TP4_MODEL, nproc=1),
        "mla": mla_reference,
        "gelu": run_pretrain(workdir / "reference_gelu", GELU, nproc=1),
    }


@pytest.mark.parametrize(
    ("label", "reference", "overrides", "nproc"),
    [
        ("tp2", "harness", ["parallel.tp=2"], 2),
        ("tp2_sp", "harness", ["parallel.tp=2", "parallel.sp=true"], 2),
        ("tp2_sp_doc_mask", "doc_mask", ["parallel.tp=2", "parallel.sp=true"], 2),
        ("tp4_padded_vocab", "tp4_model", [*TP4_MODEL, "parallel.tp=4"], 4),
        ("tp4_sp_padded_vocab", "tp4_model", [*TP4_MODEL, "parallel.tp=4", "parallel.sp=true"], 4),
        # DDP over TP's DTensor weights runs on FSDP2's replicate (ZeRO-3 with tp: the 3-D
        # and context-parallel tests).
        ("tp2_dp2_ddp", "harness", ["parallel.tp=2", "parallel.zero=0"], 4),
        ("tp2_full_recompute", "harness", ["parallel.tp=2", "recompute=full"], 2),
        ("mla_tp2_sp", "mla", [*MLA, "parallel.tp=2", "parallel.sp=true"], 2),
        ("gelu_tp2_sp", "gelu", [*GELU, "parallel.tp=2", "parallel.sp=true"], 2),
        (
            "tp2_sp_selective_recompute",
            "harness",
            ["parallel.tp=2", "parallel.sp=true", "recompute=selective"],
            2,
        ),
    ],
)
def test_tensor_parallel_layout_matches_reference(
    workdir, references, doc_mask_overrides, grad_norm_tolerance, label, reference, overrides, nproc
) -> None:
    expected = references[reference]
    data = doc_mask_overrides if reference == "doc_mask" else []
    curve = run_pretrain(workdir / label, [*data, *overrides], nproc=nproc)
    assert_same_curve(curve, expected, grad_norm_tolerance)
