"""Muon: torch's update rule, orthogonalized updates, and which parameters it updates."""

from __future__ import annotations

import torch
from torch import nn

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import OptimConfig
from pretrain.models.init import init_weights
from pretrain.trainer.optim.muon import Muon, orthogonalize
from pretrain.trainer.optim.optimizers import build_optimizer


def test_with_bf16_newton_schulz_the_update_is_torch_optim_muons() -> None:
    torch.manual_seed(0)
    start = torch.randn(24, 40)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = Muon([{"params": [ours], "muon": True}], lr=0.01, momentum=0.95, weight_decay=0.1)
    optimizer.ns_dtype = torch.bfloat16
    reference = torch.optim.Muon(
        [theirs], lr=0.01, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    for _ in range(4):
        grad = torch.randn(24, 40)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_orthogonalized_updates_have_singular_values_near_one_for_each_stacked_matrix() -> None:
    torch.manual_seed(0)
    stack = torch.randn(3, 48, 32) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    result = orthogonalize(stack)
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.5 and singular.max() < 1.5
    for i in range(3):
        torch.testing.assert_close(result[i], orthogonalize(stack[i]), rtol=1e-5, atol=1e-6)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    cfg = ModelConfig(
        vocab_size=64, dim=32, n_heads=2, ffn_dim=64, n_layers=2, moe_experts=4, moe_ffn_dim=32,
        moe_shared_experts=1, moe_layers="after:1",
    )  # fmt: skip
    model = models.build(cfg)
    init_weights(model, seed=0)
    optimizer = build_optimizer(
        model, OptimConfig(name="muon"), global_batch=1, device=torch.device("cpu")
    )
    names = {id(p): n for n, p in model.named_parameters()}
    by_muon = {True: set(), False: set()}
    for group in optimizer.param_groups:
        by_muon[group["muon"]].update(names[id(p)] for p in group["params"])
    assert all(names.startswith("layers.") and not names.endswith("norm.weight")
               for names in by_muon[True])  # fmt: skip
    assert "layers.1.feed_forward.experts.w1" in by_muon[True]
    assert "layers.1.feed_forward.router.weight" in by_muon[True]
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= by_muon[False]
    assert "layers.0.attention_norm.weight" in by_muon[False]
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
