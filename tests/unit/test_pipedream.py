"""PipeDream-2BW: the order it runs, its bubble against 1F1B's, and its weight updates
checked exactly against the 2BW recurrence on a hand-computable two-stage pipeline.

(a) Two stages, each a scalar weight (y = w0 x, z = w1 y, loss (z - t)^2 / 2 per
micro-batch, averaged over the step's 2 micro-batches), plain SGD, run by the engines of
`parallel/pipeline/pipedream.py` in one process. The 2BW recurrence (Narayanan et al. 2021) is
W(t+1) = W(t) - lr grad f_t(W(t-1)) with W(0) = W(1): every micro-batch of step t runs on
W(t), also the one whose backward runs after W(t+1) exists (weight stashing), and its
gradient lands one step late. The expected weights are computed below in plain Python.
(b) The seeds' example: two batches of 8 micro-batches on 4 stages idle 27% of the time
flushed after each (1F1B), 16% run back to back (2BW); measured wall-clock figures are in
bench/pipeline_bubble.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pretrain.core import pipedream
from pretrain.launcher.plan.pipeline.schedule_sim import bubble_fraction, pipedream_bubble, simulate
from pretrain.parallel.pipeline.pipedream import (
    LocalTransport,
    PipeDream,
    Version,
    local_drain,
    local_step,
)

LR, M = 0.1, 2
INIT = (0.5, 1.5)
# (inputs, targets) of the 2 micro-batches of each step.
DATA = [
    ([1.0, 2.0], [3.0, 1.0]),
    ([-1.0, 0.5], [2.0, 0.0]),
    ([2.0, 1.0], [1.0, 4.0]),
    ([0.5, -2.0], [0.0, 1.0]),
    ([1.5, 1.0], [2.0, -1.0]),
]


class Scale(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def sgd(target: Version, source: Version) -> None:
    with torch.no_grad():
        for p in target.params:
            p -= LR * p.grad
            p.grad = None


def two_stage_pipeline() -> list[PipeDream]:
    mailbox: dict = {}
    return [
        PipeDream(
            (Version(Scale(w)), Version(Scale(w))),
            2,
            rank,
            M,
            lambda z, t: 0.5 * (z - t).pow(2).sum() / M,
            LocalTransport(mailbox, rank),
            sgd,
        )
        for rank, w in enumerate(INIT)
    ]


def recurrence() -> list[tuple[float, float]]:
    """W(0), W(1), ... by hand: the gradient of step t at W(t) updates W(t+1)."""
    w = [INIT, INIT]
    for t, (xs, ts) in enumerate(DATA):
        w0, w1 = w[t]
        g0 = sum((w1 * w0 * x - y) * w1 * x for x, y in zip(xs, ts, strict=True)) / M
        g1 = sum((w1 * w0 * x - y) * w0 * x for x, y in zip(xs, ts, strict=True)) / M
        w.append((w[t + 1][0] - LR * g0, w[t + 1][1] - LR * g1))
    return w


def batch(values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.float64) for v in values]


def test_a_two_stage_updates_follow_the_2bw_recurrence_exactly() -> None:
    engines, expected = two_stage_pipeline(), recurrence()
    for t, (xs, ts) in enumerate(DATA):
        losses = local_step(engines, batch(xs), batch(ts))
        # Step t ran on W(t) (its loss says so) and leaves W(t+1) the newest version.
        w0, w1 = expected[t]
        assert [loss.item() for loss in losses] == pytest.approx(
            [0.5 * (w1 * w0 * x - y) ** 2 / M for x, y in zip(xs, ts, strict=True)], abs=1e-15
        )
        newest = tuple(engine.newest.params[0].item() for engine in engines)
        assert newest == pytest.approx(expected[t + 1], abs=1e-15)
    local_drain(engines)
    assert tuple(e.newest.params[0].item() for e in engines) == pytest.approx(expected[-1])
    assert tuple(e.running.params[0].item() for e in engines) == pytest.approx(expected[-2])
    # A synchronous update (W(t+1) = W(t) - lr grad f_t(W(t))) lands elsewhere.
    assert expected[3] != pytest.approx(synchronous_sgd()[3], abs=1e-3)


def synchronous_sgd() -> list[tuple[float, float]]:
    w = [INIT]
    for xs, ts in DATA:
        w0, w1 = w[-1]
        g0 = sum((w1 * w0 * x - y) * w1 * x for x, y in zip(xs, ts, strict=True)) / M
        g1 = sum((w1 * w0 * x - y) * w0 * x for x, y in zip(xs, ts, strict=True)) / M
        w.append((w0 - LR * g0, w1 - LR * g1))
    return w


def test_the_pipeline_is_not_flushed_between_steps() -> None:
    engines = two_stage_pipeline()
    local_step(engines, batch(DATA[0][0]), batch(DATA[0][1]))
    # The first stage's last micro-batch is still in flight, on the version step 0 used.
    assert list(engines[0].inflight) == [1]
    assert engines[0].inflight[1][0] is not engines[0].running
    assert engines[1].inflight == {}


def test_each_step_runs_its_forwards_and_the_previous_steps_last_backwards() -> None:
    assert pipedream.step_ops(4, 8, 0, 1) == [
        ("F", 8), ("B", 5), ("F", 9), ("B", 6), ("F", 10), ("B", 7), ("F", 11), ("B", 8),
        ("F", 12), ("B", 9), ("F", 13), ("B", 10), ("F", 14), ("B", 11), ("F", 15), ("B", 12),
    ]  # fmt: skip
    assert pipedream.drain(4, 8, 0, 2) == [("B", 13), ("B", 14), ("B", 15)]
    assert pipedream.step_ops(4, 8, 3, 1)[:2] == [("F", 8), ("B", 8)]  # the last stage: 1F1B


def test_b_two_8_microbatch_steps_idle_27_percent_flushed_and_16_percent_continuous() -> None:
    flushed = simulate("1f1b", 4, 8, w=0)  # each step alike: the flush repeats its bubble
    continuous = simulate("2bw", 4, 8, w=0, steps=2)
    assert flushed.bubble_fraction == pytest.approx(3 / 11)  # 27.3%
    assert continuous.bubble_fraction == pytest.approx(3 / 19)  # 15.8%
    # Over a segment of S steps 2BW idles (p-1)/(Sm + p-1); 1F1B's bubble stays per step.
    for steps in (1, 4, 100):
        assert pipedream_bubble(4, 8, steps) == pytest.approx(3 / (8 * steps + 3))
    # Extrapolated from 3 simulated steps, as exact as simulating them all.
    for f, b, w in ((1, 1, 1), (1, 2, 1), (1, 1, 0)):
        full = simulate("2bw", 4, 8, f=f, b=b, w=w, steps=6).bubble_fraction
        assert pipedream_bubble(4, 8, 6, f, b, w) == pytest.approx(full)
    assert bubble_fraction("2bw", 4, 8, steps=100) == pytest.approx(3 / 803)
