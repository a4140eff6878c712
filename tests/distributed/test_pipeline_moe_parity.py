"""A pipelined mixture-of-experts model reproduces the single-process MoE run.

FP32 on CPU, relative 1e-5 per step on the loss and the gradient norm, as for data
parallelism. The model is the harness's with the tiny_moe recipe's experts (first layer
dense, the other three MoE). The router losses of every stage must join the objective of
the micro-batch that produced them (without them the gradient norm is off by ~15% here), and
the expert-load metrics, gathered from the stages, must count every MoE layer once per
micro-batch: the same tokens per expert, and the same router losses, as the reference.

- interleaved 1F1B, pp=2 x vpp=2 on 2 ranks: one layer per stage, so the first stage has no
  MoE layer and each rank runs two chunks;
- 1F1B, pp=2 x ep=2 x ZeRO-2 on 4 ranks: expert gradients reduced over their own ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import (
    FP32_TOLERANCE,
    assert_same_curve,
    max_relative_difference,
    run_pretrain,
)

pytestmark = pytest.mark.distributed

MOE = ["model.moe_ffn_dim=64"]
COUNTS = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_tokens_per_expert_mean")
LOSSES = ("moe_aux_loss", "moe_z_loss")


def moe_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith("moe_")} for row in rows]


@pytest.mark.parametrize(
    ("label", "overrides", "nproc"),
    [
        (
            "interleaved_pp2_vpp2",
            ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"],
            2,
        ),
        ("1f1b_pp2_ep2_zero2", ["parallel.pp=2", "parallel.ep=2", "parallel.zero=2"], 4),
    ],
)
def test_pipelined_moe_matches_reference(
    workdir, moe_reference, moe_reference_run, grad_norm_tolerance, label, overrides, nproc
) -> None:
    curve = run_pretrain(workdir / label, MOE + overrides, nproc=nproc, recipe="tiny_moe")
    assert_same_curve(curve, moe_reference, grad_norm_tolerance)
    expected = moe_metrics(moe_reference_run)
    got = moe_metrics(workdir / label)
    assert [{k: row[k] for k in COUNTS} for row in got] == [
        {k: row[k] for k in COUNTS} for row in expected
    ]
    for key in LOSSES:
        measured, wanted = [row[key] for row in got], [row[key] for row in expected]
        assert max_relative_difference(measured, wanted) <= FP32_TOLERANCE
