"""Optimizer groups, lr scaling, optimizer choice and the in-repo Lion."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.core.schema import OptimConfig
from pretrain.trainer.optim.optimizers import (
    Lion,
    build_optimizer,
    optimizer_spec,
    param_groups,
    scaled_lr,
)


class TinyLM(nn.Module):
    """Embedding, a biased linear, a norm and an LM head (the head registered first)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.head = nn.Linear(8, 10, bias=False)
        self.tok = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.tok(ids))))


def names_by_decay(model: nn.Module, groups: list[dict]) -> tuple[list[str], list[str]]:
    """Parameter names in groups with and without weight decay (each occurrence listed)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = [], []
    for group in groups:
        target = decay if group["weight_decay"] > 0 else no_decay
        target.extend(name_of[id(p)] for p in group["params"])
    return sorted(decay), sorted(no_decay)


def test_only_linear_weights_decay_and_norms_biases_embeddings_do_not() -> None:
    model = TinyLM(tie=False)
    decay, no_decay = names_by_decay(model, param_groups(model, weight_decay=0.1))
    assert decay == ["head.weight", "proj.weight"]
    assert no_decay == ["norm.weight", "proj.bias", "tok.weight"]


def test_tied_lm_head_is_one_embedding_parameter_without_decay() -> None:
    model = TinyLM(tie=True)
    groups = param_groups(model, weight_decay=0.1)
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))
    decay, no_decay = names_by_decay(model, groups)
    # named_parameters reports the shared tensor under its first name, head.weight.
    assert decay == ["proj.weight"]
    assert no_decay == ["head.weight", "norm.weight", "proj.bias"]


def test_frozen_parameters_are_left_out() -> None:
    model = TinyLM(tie=False)
    model.proj.weight.requires_grad_(False)
    decay, _ = names_by_decay(model, param_groups(model, weight_decay=0.1))
    assert decay == ["head.weight"]


@pytest.mark.parametrize(
    ("scaling", "expected_ratio"),
    [("none", 1.0), ("linear", 64 / 16), ("sqrt", math.sqrt(64 / 16))],
)
def test_scaled_lr_follows_the_rule_relative_to_the_base_batch(
    scaling: str, expected_ratio: float
) -> None:
    cfg = OptimConfig(lr=3e-4, lr_scaling=scaling, base_batch=16)
    assert scaled_lr(cfg, global_batch=64) == pytest.approx(3e-4 * expected_ratio)


def test_scaled_lr_without_base_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match="base_batch"):
        scaled_lr(OptimConfig(lr_scaling="linear", base_batch=0), global_batch=64)


def test_adamw_is_fused_on_cuda_and_cpu_and_foreach_elsewhere() -> None:
    cfg = OptimConfig(name="adamw", betas=[0.8, 0.9], eps=1e-6)
    cls, cuda_kwargs = optimizer_spec(cfg, torch.device("cuda"))
    _, cpu_kwargs = optimizer_spec(cfg, torch.device("cpu"))
    _, meta_kwargs = optimizer_spec(cfg, torch.device("meta"))
    assert cls is torch.optim.AdamW
    assert cuda_kwargs == {"lr": cfg.lr, "betas": (0.8, 0.9), "eps": 1e-6, "fused": True}
    assert cpu_kwargs == cuda_kwargs
    assert meta_kwargs == {"lr": cfg.lr, "betas": (0.8, 0.9), "eps": 1e-6, "foreach": True}


def test_sgd_uses_momentum_and_lion_is_the_in_repo_class() -> None:
    sgd_cls, sgd_kwargs = optimizer_spec(OptimConfig(name="sgd", momentum=0.7), torch.device("cpu"))
    lion_cls, _ = optimizer_spec(OptimConfig(name="lion"), torch.device("cpu"))
    assert sgd_cls is torch.optim.SGD and sgd_kwargs["momentum"] == 0.7
    assert lion_cls is Lion
    with pytest.raises(ValueError, match="adamw, lion, sgd or muon"):
        optimizer_spec(OptimConfig(name="adam"), torch.device("cpu"))


def test_build_optimizer_puts_the_scaled_peak_lr_and_decay_in_every_group() -> None:
    cfg = OptimConfig(lr=1e-3, weight_decay=0.05, lr_scaling="linear", base_batch=8)
    optimizer = build_optimizer(TinyLM(tie=False), cfg, global_batch=32, device=torch.device("cpu"))
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3 * 32 / 8] * 2
    assert sorted(g["weight_decay"] for g in optimizer.param_groups) == [0.0, 0.05]


def test_lion_single_steps_match_the_update_rule_by_hand() -> None:
    lr, beta1, beta2, wd = 0.1, 0.9, 0.99, 0.5
    p0, g1, g2 = [1.0, -2.0, 0.5], [0.3, -0.1, 0.2], [-0.5, 0.4, -0.001]
    param = nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    optimizer = Lion([param], lr=lr, betas=(beta1, beta2), weight_decay=wd)

    def sign(x: float) -> float:
        return math.copysign(1.0, x) if x else 0.0

    expected, momentum = list(p0), [0.0, 0.0, 0.0]
    for grad in (g1, g2):
        param.grad = torch.tensor(grad, dtype=torch.float64)
        optimizer.step()
        for i, g in enumerate(grad):
            update = sign(beta1 * momentum[i] + (1 - beta1) * g)
            expected[i] = expected[i] * (1 - lr * wd) - lr * update
            momentum[i] = beta2 * momentum[i] + (1 - beta2) * g
        assert param.tolist() == pytest.approx(expected, rel=1e-12)
    # The third coordinate's second update follows the momentum, not the fresh gradient.
    assert sign(beta1 * (1 - beta2) * g1[2] + (1 - beta1) * g2[2]) != sign(g2[2])


def test_lion_converges_on_a_quadratic() -> None:
    torch.manual_seed(0)
    target = torch.randn(16)
    x = nn.Parameter(torch.zeros(16))
    lr = 0.01
    optimizer = Lion([x], lr=lr, betas=(0.9, 0.95))
    start = (x.detach() - target).abs().max().item()
    for _ in range(int(start / lr) + 100):
        optimizer.zero_grad()
        (0.5 * (x - target).pow(2).sum()).backward()
        optimizer.step()
    # Sign updates move every coordinate by lr per step: it ends oscillating within ~lr.
    assert (x.detach() - target).abs().max().item() < 2 * lr


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd", "muon"])
def test_groups_never_mix_dtensors_and_plain_tensors_so_foreach_steps_work(
    single_rank_group: None, name: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = TinyLM(tie=False)
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"proj": ColwiseParallel()})
    groups = param_groups(model, weight_decay=0.1)
    for group in groups:
        assert len({isinstance(p, DTensor) for p in group["params"]}) == 1
    decay, no_decay = names_by_decay(model, groups)
    assert decay == ["head.weight", "proj.weight"]
    assert no_decay == ["norm.weight", "proj.bias", "tok.weight"]

    optimizer = build_optimizer(
        model, OptimConfig(name=name), global_batch=1, device=torch.device("cpu")
    )
    before = model.proj.weight.full_tensor().clone()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    assert not torch.equal(model.proj.weight.full_tensor(), before)


def test_every_optimizer_the_schema_allows_has_a_factory() -> None:
    from pretrain.core.schema import OPTIMIZERS, OptimConfig
    from pretrain.trainer.optim.optimizers import optimizer_spec

    for name in OPTIMIZERS:
        optimizer_class, _ = optimizer_spec(OptimConfig(name=name), torch.device("cpu"))
        assert issubclass(optimizer_class, torch.optim.Optimizer)
