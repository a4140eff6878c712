"""The planner's peak memory per rank against a measured training step of the tiny model.

Each layout trains through `python -m pretrain.trainer.observe.memcheck` under torchrun (the
trainer's own
build and step, tracked by MemTracker; under pipeline parallelism each rank runs its stage's
part of the schedule); the prediction comes from pretrain.launcher.plan.memory for the measuring
rank's
pipeline stage. The total must be within 10%; the error per category is printed in a table
(pytest -s, and in the failure message). Measured on the 2-core CPU machine, torch 2.13
(model minus measured, over measured; "other" is activations, transients and logits):

| layout | rank | params | grads | optimizer | other | total |
| --- | --- | --- | --- | --- | --- | --- |
| ddp | 0 | +0.0% | +0.0% | -0.0% | -0.0% | -0.0% |
| zero1 | 0 | +0.0% | +0.0% | -0.2% | -0.0% | -0.0% |
| zero2 | 0 | +0.0% | +0.0% | -0.0% | -0.0% | -0.0% |
| zero3 | 0 | +0.0% | +0.0% | -0.0% | -0.0% | -0.0% |
| zero3_full_recompute | 0 | +0.0% | +10.3% | -0.0% | -0.1% | +2.0% |
| ddp_selective_recompute | 0 | +0.0% | +0.0% | -0.0% | -0.1% | -0.0% |
| tp2 | 0 | +0.0% | -11.1% | -0.0% | -0.5% | -1.6% |
| tp2_sp | 0 | +0.0% | -11.1% | -0.0% | -0.6% | -1.7% |
| pp2_1f1b | 0 | +0.0% | +0.0% | -0.0% | -0.3% | -0.2% |
| pp2_1f1b | 1 | +0.0% | +0.0% | -0.0% | -5.2% | -2.8% |
| pp2_gpipe | 0 | +0.0% | -100.0% | -0.0% | +1.5% | +0.5% |
| pp2_gpipe | 1 | +0.0% | - | -0.0% | -0.1% | -0.1% |
| moe_ep2 | 0 | +0.0% | +0.0% | -0.0% | +3.9% | +1.6% |
| moe_tp2_etp2 | 0 | +0.0% | -3.5% | -0.0% | +7.8% | +2.3% |

Left unmodelled: under TP the peak (in the head's backward, accumulating) also holds that
micro-batch's fresh LM-head gradient (the -11% of grads, -3.5% beside the MoE model's
experts); GPipe's peak is in its first
backward, with the last block's first weight gradients already there (measured 48 KiB,
modelled as none); ZeRO-3 with full recompute holds fewer unsharded gradients at its peak
than modelled; the 1F1B last stage holds ~0.1 MiB more than its counted tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.plan.memory import memory_breakdown
from pretrain.launcher.plan.memory_fit import predict

pytestmark = pytest.mark.distributed

TOLERANCE = 0.10
CATEGORIES = ("params", "grads", "optimizer", "other", "total")
# The tiny_moe recipe's mixture (recipes/model/tiny_moe.yaml) on the tiny shape.
MOE = {
    "model.moe_experts": 8,
    "model.moe_top_k": 2,
    "model.moe_shared_experts": 1,
    "model.moe_ffn_dim": 128,
    "model.moe_layers": "after:1",
    "model.moe_z_loss_coef": 0.001,
}
LAYOUTS = [
    ("ddp", {"parallel.zero": 0}),
    ("zero1", {"parallel.zero": 1}),
    ("zero2", {"parallel.zero": 2}),
    ("zero3", {"parallel.zero": 3}),
    ("zero3_full_recompute", {"parallel.zero": 3, "recompute.policy": "full"}),
    ("ddp_selective_recompute", {"recompute.policy": "selective"}),
    ("tp2", {"parallel.tp": 2}),
    ("tp2_sp", {"parallel.tp": 2, "parallel.sp": True}),
    ("pp2_1f1b", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("pp2_gpipe", {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    ("moe_ep2", {**MOE, "parallel.ep": 2}),
    # The experts split over the two tp ranks; the router and shared expert stay whole.
    ("moe_tp2_etp2", {**MOE, "parallel.tp": 2, "parallel.etp": 2}),
]


def tiny_recipe(overrides: dict, nproc: int = 2) -> RecipeConfig:
    cfg = RecipeConfig(name="memcheck")
    m = cfg.model
    m.vocab_size, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.n_layers = 512, 64, 4, 2, 192, 4
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 64, 2, 8
    cfg.cluster.device, cfg.cluster.gpu_type, cfg.cluster.gpus_per_node = "cpu", "cpu", nproc
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def predicted_by_stage(cfg: RecipeConfig) -> dict[int, dict[str, float]]:
    """The model's categories for each pipeline rank, named as the measurement names them."""
    degrees = resolve_degrees(cfg)
    micro = cfg.parallel.pp_microbatches or grad_accum_steps(cfg)
    stages = {}
    for rank in range(degrees.pp):
        b = memory_breakdown(cfg, degrees, micro, rank)
        other = b.activations + b.transients + b.logits
        stages[rank] = dict(
            zip(CATEGORIES, (b.params, b.grads, b.optimizer, other, b.total), strict=True)
        )
    return stages


def error_table(label: str, rows: dict[int, tuple[dict, dict]]) -> str:
    """Markdown rows: model minus measured over measured, per category, per pipeline rank."""
    lines = []
    for rank, (predicted, measured) in sorted(rows.items()):
        cells = [
            f"{(predicted[k] - measured[k]) / measured[k]:+.1%}" if measured[k] else "-"
            for k in CATEGORIES
        ]
        lines.append(f"| {label} | {rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize(("label", "overrides"), LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_predicted_peak_is_within_10_percent_of_the_measured_step(tmp_path, label, overrides):
    cfg = tiny_recipe(overrides)
    config, out = tmp_path / "config.yaml", tmp_path / "memory.json"
    config.write_text(dump_config(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "pretrain.trainer.observe.memcheck", str(config), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    stages = predicted_by_stage(cfg)
    rows = {}
    for rank in json.loads(out.read_text()):
        stage = rank["pp_rank"]
        if stage not in rows or rank["total"] > rows[stage][1]["total"]:
            rows[stage] = (stages[stage], rank)
    table = error_table(label, rows)
    print("\n" + table)
    for predicted, measured in rows.values():
        error = (predicted["total"] - measured["total"]) / measured["total"]
        assert abs(error) <= TOLERANCE, f"{label}: total off by {error:+.1%}\n{table}"
    # Without pipeline parallelism the plan's peak is this rank's.
    assert predict(cfg).total == max(predicted["total"] for predicted, _ in rows.values())
