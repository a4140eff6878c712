"""Router losses ride on a pipeline stage's output: its backward adds their weighted gradient."""

from __future__ import annotations

import torch

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.models.init import init_weights
from pretrain.models.moe import moe_modules, router_losses
from pretrain.parallel.pipeline.moe import AttachLoss, attach_router_losses

CFG = ModelConfig(
    vocab_size=64,
    dim=16,
    n_heads=2,
    ffn_dim=32,
    n_layers=2,
    moe_experts=4,
    moe_top_k=2,
    moe_aux_loss_coef=0.5,
    moe_z_loss_coef=0.1,
)
WEIGHT = 0.25  # one micro-batch of four, no loss scale


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_stage_backward_adds_the_weighted_router_losses_of_its_own_forward() -> None:
    tokens = torch.randint(0, 64, (2, 8))
    reference = models.build(CFG)
    init_weights(reference, seed=0)
    logits = reference(tokens)
    (WEIGHT * (logits.square().mean() + router_losses(reference))).backward()

    stage = models.build(CFG)
    init_weights(stage, seed=0)
    attach_router_losses(stage, lambda: torch.tensor(WEIGHT))
    first, second = stage(tokens), stage(tokens.flip(0))
    # Backward of the first micro-batch after the second's forward, as 1F1B orders them.
    (WEIGHT * first.square().mean()).backward()

    for got, want in zip(gradients(stage), gradients(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    assert second.requires_grad
    assert all(m.aux_loss is None for m in moe_modules(stage))
    assert [m.stats.forwards for m in moe_modules(stage)] == [2, 2]


def test_dense_chunk_is_left_as_it_is() -> None:
    dense = models.build(ModelConfig(vocab_size=64, dim=16, n_heads=2, ffn_dim=32, n_layers=1))
    forward = dense.forward
    attach_router_losses(dense, lambda: torch.tensor(WEIGHT))
    assert dense.forward == forward


def test_the_attached_output_can_be_detached_in_place_after_the_input_pass() -> None:
    """The split-backward schedules detach a stage's output in place once its input gradient
    is computed (torch's `stage_backward_input`); a view of the block's output refuses that."""
    x = torch.randn(3, requires_grad=True)
    aux = torch.zeros((), requires_grad=True)
    out = AttachLoss.apply(x * 2, aux, torch.tensor(0.5))
    torch.autograd.grad(out.sum(), [x, aux], retain_graph=True)
    assert not out._is_view()
    out.detach_()
