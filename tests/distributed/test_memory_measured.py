"""The planner's peak memory per rank against a measured training step of the tiny model.

Each layout trains through `python -m trainer.memcheck` under torchrun (the trainer's own
build and step, tracked by MemTracker); the prediction comes from launcher.memory. The
total must be within 10%; the error per category is printed (pytest -s) for the record.
New layouts (TP, PP, MoE) are one entry each in LAYOUTS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.fit import predict
from launcher.schema import RecipeConfig, dump_config

pytestmark = pytest.mark.distributed

TOLERANCE = 0.10
LAYOUTS = [
    ("ddp", {"parallel.zero": 0}),
    ("zero1", {"parallel.zero": 1}),
    ("zero2", {"parallel.zero": 2}),
    ("zero3", {"parallel.zero": 3}),
    ("zero3_full_recompute", {"parallel.zero": 3, "recompute.policy": "full"}),
    ("ddp_selective_recompute", {"recompute.policy": "selective"}),
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


@pytest.mark.parametrize(("label", "overrides"), LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_predicted_peak_is_within_10_percent_of_the_measured_step(tmp_path, label, overrides):
    cfg = tiny_recipe(overrides)
    config, out = tmp_path / "config.yaml", tmp_path / "memory.json"
    config.write_text(dump_config(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "trainer.memcheck", str(config), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = max(json.loads(out.read_text()), key=lambda rank: rank["total"])
    b = predict(cfg)
    predicted = {
        "params": b.params,
        "grads": b.grads,
        "optimizer": b.optimizer,
        "other": b.activations + b.transients + b.logits,
        "total": b.total,
    }
    errors = {k: (v - measured[k]) / measured[k] for k, v in predicted.items() if measured[k]}
    print(f"{label}: " + ", ".join(f"{k} {e:+.1%}" for k, e in errors.items()))
    assert abs(errors["total"]) <= TOLERANCE, (label, predicted, measured)
