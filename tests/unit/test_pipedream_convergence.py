"""(c) PipeDream-2BW's final loss stays within a stated margin of synchronous training's.

The harness-sized tiny model (0.26M parameters, 64-token sequences, 8 per step, in two
micro-batches: a step's math does not depend on how it is split) for 200 steps with the tiny
recipe's optimizer (AdamW, peak lr 2e-3, 20 warmup steps, cosine to 2e-4), once
synchronously (what 1F1B computes, equal to the one-process run) and once under 2BW over 2
stages, both in one process over the real stage modules (`tests/pipedream_oracle.py`; the
distributed run equals it, tests/distributed/test_pipedream.py). Stated margin: 2BW's mean
loss over the last 20 steps within 10% of the synchronous run's (measured: 6.8%, 4.098
against 3.837). `bench/pipedream_convergence.py` runs the shipped tiny recipe (1.8M
parameters, 128 x 16 tokens per step) for 300 steps: 14.5% there (bench/README.md). One step
of staleness slows the descent at these learning rates and lengths; the 2BW paper reports
final quality close to the flushed baseline on large models trained much longer."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import BASE_OVERRIDES
from tests.helpers import compose_recipe
from tests.pipedream_oracle import pipedream_curve, synchronous_curve

STEPS, TAIL, MARGIN = 200, 20, 0.10
SETTINGS = [
    f"train.steps={STEPS}",
    "optim.lr=2e-3",
    "optim.min_lr=2e-4",
    "schedule.warmup_steps=20",
    "train.micro_batch=4",
    "parallel.pp=2",
    "parallel.pp_schedule=2bw",
]


@pytest.mark.slow
def test_c_2bw_final_loss_is_within_10_percent_of_synchronous() -> None:
    cfg = compose_recipe("tiny", [*BASE_OVERRIDES, "cluster.gpus_per_node=2", *SETTINGS])
    torch.set_num_threads(1)
    two_bw = [loss for loss, _ in pipedream_curve(cfg, STEPS)]
    synchronous = [loss for loss, _ in synchronous_curve(cfg, STEPS)]
    final_2bw, final_sync = sum(two_bw[-TAIL:]) / TAIL, sum(synchronous[-TAIL:]) / TAIL
    assert final_2bw <= final_sync * (1 + MARGIN)
    # It learned (from ln 512 = 6.24), and it is not the synchronous run under another name.
    assert final_2bw < 0.75 * two_bw[0]
    assert two_bw[1] != synchronous[1]
