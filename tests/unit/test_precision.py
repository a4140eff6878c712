"""FP8 module swap (linears, the experts' grouped GEMMs, never the router) and FP16 dynamic
loss scaling, in one process on CPU."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pretrain import models
from pretrain.core.layout import Degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import PrecisionConfig, RecipeConfig
from pretrain.parallel.fp8_experts import Fp8Experts, aligned_groups, aligned_rows
from pretrain.parallel.fp8_linear import BlockScaledLinear
from pretrain.parallel.materialize import materialize
from pretrain.parallel.precision import LossScaler, apply_precision
from pretrain.trainer.faults.step_guard import StepGuard
from pretrain.trainer.optim.lr_schedule import build_lr_scheduler
from pretrain.trainer.optim.optimizers import build_optimizer
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import train_step
from pretrain.trainer.step.state import TrainState

ONE_RANK = Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=1, ep=1, world=1)
BLOCK_LINEARS = (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)  # fmt: skip


def recipe(**precision) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model = ModelConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
    )
    cfg.precision = PrecisionConfig(**precision)
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 32, 2, 2
    cfg.schedule.warmup_steps = 0
    cfg.cluster.device = "cpu"
    return cfg


def test_fp8_swaps_exactly_the_block_linears_and_keeps_the_rest_in_high_precision():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    cfg = recipe(dtype="fp8", fp8_emulate=True)
    model = models.build(cfg.model)
    names_before = [name for name, _ in model.named_parameters()]
    converted = apply_precision(model, cfg.precision)

    expected = [f"layers.{i}.{name}" for i in range(cfg.model.n_layers) for name in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected)
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert fp8 == sorted(expected)
    assert type(model.output) is nn.Linear  # the LM head
    assert type(model.tok_embeddings) is nn.Embedding
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    assert len(norms) == 2 * cfg.model.n_layers + 1
    assert all(type(m).__name__ == "RMSNorm" for m in norms)
    assert [name for name, _ in model.named_parameters()] == names_before


def moe_model() -> nn.Module:
    """Two blocks, the second a MoE whose router (64 -> 16) FP8 matmuls would take."""
    shape = dataclasses.replace(
        recipe().model,
        moe_experts=16,
        moe_top_k=2,
        moe_ffn_dim=64,
        moe_shared_experts=1,
        moe_layers="after:1",
    )
    return models.build(shape)


@pytest.mark.parametrize(
    ("scaling", "experts"), [("current", False), ("rowwise", True), ("mxfp8", True)]
)
def test_fp8_never_converts_the_router_and_runs_experts_in_fp8_where_torchao_can(scaling, experts):
    pytest.importorskip("torchao")
    model = moe_model()
    precision = PrecisionConfig(dtype="fp8", fp8_recipe=scaling, fp8_emulate=True)
    converted = apply_precision(model, precision)
    moe = model.layers["1"].feed_forward
    assert type(moe.router) is nn.Linear
    assert "layers.1.feed_forward.router" not in converted
    assert "layers.1.feed_forward.shared.w1" in converted  # the shared expert is a dense MLP
    assert ("layers.1.feed_forward.experts" in converted) == experts
    assert (moe.experts.kernel is not None) == experts


def test_aligned_groups_start_every_expert_at_a_whole_block():
    ends = torch.tensor([3, 3, 20, 21], dtype=torch.int32)  # groups of 3, 0, 17 and 1 rows
    dest, offs = aligned_groups(ends, 21, 8)
    assert dest.tolist() == [0, 1, 2, *range(8, 25), 32]
    # 8 + 0 + 24 + 8 = 40 rows at most; the buffer holds 21 + 4 x 7 rounded up to 56.
    assert offs.tolist() == [8, 8, 32, aligned_rows(21, 4, 8)] == [8, 8, 32, 56]


def test_mxfp8_experts_and_linear_track_their_high_precision_results():
    """torchao's MXFP8 emulation: E4M3 keeps 3 mantissa bits, so each product is off by a few
    percent; the experts' rows arrive unaligned (groups of 5, 0 and 27) and every expert
    with rows gets a gradient."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    x = torch.randn(32, 64, requires_grad=True)
    w1, w3 = (torch.randn(3, 96, 64).mul(0.1).requires_grad_() for _ in range(2))
    w2 = torch.randn(3, 64, 96).mul(0.1).requires_grad_()
    ends = torch.tensor([5, 5, 32], dtype=torch.int32)
    out = Fp8Experts("mxfp8", emulate=True)(x, w1, w3, w2, ends)
    sizes = [5, 0, 27]
    chunks = x.split(sizes)
    reference = torch.cat(
        [
            (torch.nn.functional.silu(c @ w1[e].T) * (c @ w3[e].T)) @ w2[e].T
            for e, c in enumerate(chunks)
        ]
    )
    assert ((out - reference).norm() / reference.norm()).item() < 0.1
    out.square().sum().backward()
    assert w1.grad is not None and w1.grad[1].abs().max() == 0  # expert 1 had no rows
    assert w1.grad[0].abs().max() > 0 and w2.grad[2].abs().max() > 0

    linear = nn.Linear(64, 96, bias=False)
    block = BlockScaledLinear(linear, "mxfp8", emulate=True)
    assert block.weight is linear.weight
    y = block(x)
    assert ((y - linear(x)).norm() / linear(x).norm()).item() < 0.1


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_other_precisions_swap_nothing(dtype):
    model = models.build(recipe().model)
    kinds = [type(m) for m in model.modules()]
    assert apply_precision(model, PrecisionConfig(dtype=dtype)) == []
    assert [type(m) for m in model.modules()] == kinds


def test_scale_grows_after_interval_clean_steps_and_backs_off_on_overflow():
    scaler = LossScaler(
        PrecisionConfig(dtype="fp16", loss_scale_init=1024.0, loss_scale_interval=2)
    )
    finite, inf, nan = torch.tensor(1.0), torch.tensor(math.inf), torch.tensor(math.nan)
    taken = [scaler.update(norm) for norm in (finite, finite, finite, inf, nan, finite)]
    assert taken == [True, True, True, False, False, True]
    # 1024 doubles after two clean steps; each overflow halves it and restarts the count.
    assert scaler.metrics() == {"loss_scale": 2048.0 * 0.5 * 0.5, "skipped_steps": 2}
    assert scaler.clean_steps == 1


def test_disabled_scaler_is_the_identity():
    scaler = LossScaler(PrecisionConfig(dtype="bf16"))
    loss = torch.tensor(2.5)
    assert scaler.scale_loss(loss) is loss
    assert scaler.update(torch.tensor(math.inf)) and scaler.metrics() == {}


def build_state(cfg: RecipeConfig) -> TrainState:
    plain = models.build(cfg.model)
    materialize(plain, cfg.model, cfg.seed, torch.device("cpu"))
    optimizer = build_optimizer(plain, cfg.optim, global_batch=1, device=torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.schedule, cfg.train.steps)
    return TrainState(plain, plain, optimizer, scheduler, LossScaler(cfg.precision))


def batch(cfg: RecipeConfig, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])]


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: the step's fault guard agrees across ranks with a collective."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield StepGuard(max_bad_steps=3, device=torch.device("cpu"))
    dist.destroy_process_group()


def test_an_overflowing_fp16_step_is_skipped_and_the_next_one_trains(one_rank_group):
    # 2**40 times the loss: the gradient of one logit alone is about 2**40 / 64 tokens, far
    # beyond float16's largest value 65504, so the first backward must overflow.
    cfg = recipe(dtype="fp16", loss_scale_init=2.0**40, loss_scale_backoff=2.0**-30)
    state = build_state(cfg)
    before = copy.deepcopy(state.plain.state_dict())

    guard = one_rank_group
    _, norm, bad, _ = train_step(
        StepContext(state, cfg, ONE_RANK, torch.device("cpu"), guard=guard), batch(cfg, 0)
    )
    assert not torch.isfinite(norm) and not bad  # an overflow is the scaler's, not a fault
    assert state.scaler.metrics() == {"loss_scale": 2.0**10, "skipped_steps": 1}
    after = state.plain.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert state.optimizer.state == {}  # AdamW's moments and step count were not touched
    assert all(p.grad is None for p in state.plain.parameters())

    _, norm, _, _ = train_step(
        StepContext(state, cfg, ONE_RANK, torch.device("cpu"), guard=guard), batch(cfg, 1)
    )
    assert torch.isfinite(norm) and state.scaler.skipped_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in state.plain.state_dict().items())


def test_gradients_are_unscaled_before_the_norm_is_clipped(one_rank_group):
    # Powers of two scale float16 exactly, so once unscaled the norm does not depend on the
    # scale (up to gradients that underflow at the smaller one).
    norms = []
    for scale in (2.0**4, 2.0**12):
        cfg = recipe(dtype="fp16", loss_scale_init=scale)
        cfg.optim.grad_clip = 1e-3  # clipping on: it must see the unscaled norm
        _, norm, _, _ = train_step(
            StepContext(build_state(cfg), cfg, ONE_RANK, torch.device("cpu"), guard=one_rank_group),
            batch(cfg, 0),
        )
        norms.append(norm.item())
    assert norms[0] == pytest.approx(norms[1], rel=1e-3)
    fp32 = recipe(dtype="fp32")
    _, reference, _, _ = train_step(
        StepContext(build_state(fp32), fp32, ONE_RANK, torch.device("cpu"), guard=one_rank_group),
        batch(fp32, 0),
    )
    assert norms[1] == pytest.approx(reference.item(), rel=2e-2)


def test_an_fp8_run_names_the_fp8_peak_in_every_sink():
    from pretrain.core.hardware import gpu_spec
    from pretrain.trainer.observe.loggers import console_line, wandb_key
    from pretrain.trainer.observe.metrics import ThroughputMeter, table_peak_flops

    peak = table_peak_flops("NVIDIA H100 80GB HBM3", "fp8")
    assert (peak.tflops, peak.dtype) == (gpu_spec("h100_sxm").peak_tflops["fp8"], "fp8")
    meter = ThroughputMeter(
        tokens_per_step=1000, model_flops_per_token=1e9, hardware_flops_per_token=1e9,
        devices=1, peak=peak,
    )  # fmt: skip
    metrics = meter.measure(steps=1, elapsed_s=1.0)
    assert (metrics["peak_dtype"], metrics["peak_source"]) == ("fp8", "table: h100_sxm fp8")
    assert metrics["mfu"] == pytest.approx(1e12 / (peak.tflops * 1e12))
    assert f"MFU {100 * metrics['mfu']:.1f}% of fp8 peak" in console_line(1, 1, metrics)
    assert wandb_key("peak_dtype") == "perf/peak_dtype"
    assert wandb_key("skipped_steps") == "train/skipped_steps"
