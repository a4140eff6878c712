"""The batch-size ramp and the sequence-length warm-up: each step's batch and length, the
tokens and data-order sequences before it, and the LR schedule that runs by tokens."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import (
    BatchStage,
    OptimConfig,
    RecipeConfig,
    ScheduleConfig,
    SeqLenStage,
    TrainConfig,
)
from pretrain.models.flops import flops_per_token
from pretrain.trainer.data.schedule_metrics import ramp_metrics, step_work
from pretrain.trainer.observe.metrics import PeakFlops, ThroughputMeter
from pretrain.trainer.optim.lr_schedule import build_lr_scheduler, lr_factor


def ramp(batches=(), lengths=(), global_batch: int = 8, seq_len: int = 64) -> Ramp:
    return Ramp(
        TrainConfig(
            global_batch=global_batch,
            seq_len=seq_len,
            batch_schedule=[BatchStage(b, until) for b, until in batches],
            seq_len_schedule=[SeqLenStage(s, until) for s, until in lengths],
        )
    )


def walk(r: Ramp, steps: int) -> list[tuple[int, int, int, int]]:
    """(global batch, seq_len, tokens before, sequences before) of each step, by stepping:
    a stage holds while the tokens trained before the step are under its threshold."""
    t = r.phases[0]
    full = (t.full_seq_len, r.full_batch)
    out, tokens, units = [], 0, 0
    for step in range(steps):
        phase = r.phase(step)
        out.append((phase.global_batch, phase.seq_len, tokens, units))
        tokens += phase.global_batch * phase.seq_len
        units += phase.global_batch * phase.seq_len // full[0]
    return out


def test_a_stage_switches_at_the_first_step_that_starts_at_or_past_its_threshold() -> None:
    r = ramp(batches=[(4, 1000)], lengths=[(32, 256)])
    # 4 x 32 = 128 tokens a step until 256, then 4 x 64 = 256 until 1000 (overshot: 1024),
    # then the full 8 x 64.
    assert [(p.first_step, p.steps, p.global_batch, p.seq_len) for p in r.phases] == [
        (0, 2, 4, 32),
        (2, 3, 4, 64),
        (5, None, 8, 64),
    ]
    assert [r.tokens_before(k) for k in range(8)] == [0, 128, 256, 512, 768, 1024, 1536, 2048]
    # The data order counts full-length sequences: a step of 4 x 32 reads 2 of them.
    assert [r.units_before(k) for k in range(7)] == [0, 2, 4, 8, 12, 16, 24]
    assert [r.step_of_unit(u) for u in (0, 1, 2, 3, 4, 7, 8, 15, 16, 23, 24)] == [
        0, 0, 1, 1, 2, 2, 3, 4, 5, 5, 6,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("batches", "lengths"),
    [
        ([(2, 100), (4, 700)], []),
        ([], [(8, 50), (16, 51), (32, 4000)]),
        ([(4, 3000), (6, 3001)], [(16, 10), (32, 2999)]),
    ],
)
def test_tokens_and_sequences_before_a_step_are_the_sum_of_the_steps_before(
    batches, lengths
) -> None:
    r = ramp(batches, lengths)
    for step, (batch, length, tokens, units) in enumerate(walk(r, 200)):
        phase = r.phase(step)
        assert (phase.global_batch, phase.seq_len) == (batch, length)
        assert (r.tokens_before(step), r.units_before(step)) == (tokens, units)
        assert r.first_step_at(tokens) == step
        assert r.step_of_unit(units) == step  # its first sequence of the data order


def test_without_a_ramp_every_step_is_a_full_one() -> None:
    r = ramp()
    assert not r.active and len(r.phases) == 1
    assert [r.tokens_before(k) for k in (0, 1, 10**9)] == [0, 512, 512 * 10**9]
    assert [r.full_steps(k) for k in (0, 3, 10**6)] == [0.0, 3.0, 1e6]


def test_a_step_of_short_sequences_must_read_whole_sequences_of_the_data_order() -> None:
    with pytest.raises(ValueError, match="not a whole number of sequences"):
        ramp(batches=[(3, 100)], lengths=[(32, 100)])


def test_the_planned_phases_end_at_the_run_s_last_step() -> None:
    r = ramp(batches=[(4, 1000)], lengths=[(32, 256)])
    assert [(p.first_step, p.steps) for p in r.within(7)] == [(0, 2), (2, 3), (5, 2)]
    assert [(p.first_step, p.steps) for p in r.within(4)] == [(0, 2), (2, 2)]


SCHEDULE = ScheduleConfig(name="cosine", warmup_steps=2)
OPTIM = OptimConfig(lr=1.0, min_lr=0.1)


def lrs(train: TrainConfig, steps: int, optim: OptimConfig = OPTIM) -> list[float]:
    """The lr of each of `steps` steps, as the LambdaLR the trainer builds sets them."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=optim.lr)
    scheduler = build_lr_scheduler(optimizer, optim, SCHEDULE, steps, Ramp(train))
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_without_a_ramp_the_lr_schedule_is_the_one_by_steps_bit_for_bit() -> None:
    train = TrainConfig(global_batch=8, seq_len=64)
    assert lrs(train, 12) == [
        lr_factor(k, schedule=SCHEDULE, total_steps=12, min_ratio=0.1) for k in range(12)
    ]


def test_under_a_ramp_the_lr_schedule_runs_by_tokens() -> None:
    # Steps of 128, 128, 256, 256, 256, then 512 tokens: a full step is 512.
    train = TrainConfig(
        global_batch=8,
        seq_len=64,
        batch_schedule=[BatchStage(4, 1000)],
        seq_len_schedule=[SeqLenStage(32, 256)],
    )
    rates = lrs(train, 8)
    # Warmup over 2 full steps' worth of tokens (1024): each step's share of it.
    assert rates[:5] == pytest.approx([0.125, 0.25, 0.5, 0.75, 1.0])
    # Cosine over the remaining 5 - 2 = 3 full steps, by the tokens trained through a step.
    done = [3, 4, 5]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (d - 2) / 3)) for d in done]
    assert rates[5:] == pytest.approx(cosine)


def test_lr_scaling_scales_the_ramp_s_smaller_batches_by_its_rule() -> None:
    train = TrainConfig(global_batch=8, seq_len=64, batch_schedule=[BatchStage(2, 256)])
    optim = OptimConfig(lr=1.0, min_lr=0.1, lr_scaling="sqrt", base_batch=8)
    flat = lrs(train, 3, OPTIM)
    scaled = lrs(train, 3, optim)
    assert scaled[0] == pytest.approx(flat[0] * math.sqrt(2 / 8))
    assert scaled[2] == pytest.approx(flat[2])  # the full batch: its own rate


def test_a_window_s_throughput_and_mfu_count_each_of_its_steps_own_work() -> None:
    cfg = RecipeConfig()
    cfg.train = TrainConfig(global_batch=8, seq_len=64, batch_schedule=[BatchStage(4, 1000)])
    r = Ramp(cfg.train)
    meter = ThroughputMeter(
        tokens_per_step=8 * 64,
        model_flops_per_token=1.0,
        hardware_flops_per_token=1.0,
        devices=2,
        peak=PeakFlops(1.0, "recipe"),
        step_work=step_work(cfg, r),
    )
    flops = flops_per_token(cfg.model, 64).train
    # Steps 3-6 (0-based 2-5): two of 4 x 64 tokens, then two of 8 x 64, in 2 seconds.
    metrics = meter.measure(steps=4, elapsed_s=2.0, last_step=6)
    tokens = 2 * 256 + 2 * 512
    assert metrics["tokens_per_s"] == tokens / 2.0
    assert metrics["mfu"] == pytest.approx(tokens * flops / 2.0 / 2 / 1e12)
    assert ramp_metrics(r, 6) == {"tokens": 4 * 256 + 2 * 512, "global_batch": 8, "seq_len": 64}
    assert ramp_metrics(Ramp(TrainConfig()), 6) == {}
