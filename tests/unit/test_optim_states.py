"""Optimizer states in fp32, bf16, int8 and int4: rounding, bytes, updates and checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pretrain.core.optim_states import STATE_BLOCK, STATE_DTYPES, state_bytes
from pretrain.trainer.optim.optimizers import Lion
from pretrain.trainer.optim.states import AdamW, StoredState

ROUNDING = {"bf16": 4e-3, "int8": 0.02, "int4": 0.15}
"""Largest error of a stored value, relative to its block's absolute maximum."""


def moments(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A signed first moment and a non-negative second moment spanning 6 decades, [64, 96]."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(64, 96, generator=g) * 1e-3
    v = (torch.randn(64, 96, generator=g) * 1e-3).square() * 10 ** torch.empty(64, 96).uniform_(
        -3, 3, generator=g
    )
    return m, v


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_stored_states_round_within_the_dtype_bound_of_their_block(dtype) -> None:
    for value, signed in zip(moments(), (True, False), strict=True):
        stored = StoredState(value, dtype, signed)
        stored.set(value)
        blocks = value.unflatten(-1, (-1, STATE_BLOCK))
        error = (stored.get() - value).abs().unflatten(-1, (-1, STATE_BLOCK))
        assert (error <= ROUNDING[dtype] * blocks.abs().amax(-1, keepdim=True)).all()


def test_a_quantized_second_moment_never_rounds_to_zero_at_four_bits() -> None:
    _, v = moments()
    stored = StoredState(v, "int4", signed=False)
    stored.set(v)
    assert (stored.get() > 0).all()


@pytest.mark.parametrize("dtype", STATE_DTYPES)
def test_stored_bytes_per_element_are_the_planners(dtype) -> None:
    value = torch.randn(64, 96)
    stored = StoredState(value, dtype)
    stored.set(value)
    assert stored.nbytes() / value.numel() == state_bytes(dtype)


def test_vectors_and_unblockable_rows_stay_fp32() -> None:
    for shape in ((96,), (8, 40)):
        assert StoredState(torch.zeros(shape), "int4").dtype == "fp32"


def test_fp32_adamw_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    start = torch.randn(16, 32)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt_ours, opt_theirs = AdamW([ours], **kwargs), torch.optim.AdamW([theirs], **kwargs)
    for _ in range(5):
        grad = torch.randn(16, 32)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_checkpointed_states_load_back_to_the_same_codes(optimizer, dtype) -> None:
    def build(param: nn.Parameter):
        if optimizer == "lion":
            return Lion([param], lr=1e-3, state_dtype=dtype)
        return AdamW([param], lr=1e-3, state_dtype=dtype)

    param = nn.Parameter(torch.randn(8, 64))
    first = build(param)
    for _ in range(3):
        param.grad = torch.randn(8, 64)
        first.step()
    saved = first.state_dict()
    assert all(v.dtype == torch.float32 for v in saved["state"][0].values() if v.ndim)
    second = build(param)
    second.load_state_dict(saved)
    for name, stored in first.state[param].items():
        loaded = second.state[param][name]
        if isinstance(stored, StoredState):
            assert torch.equal(loaded.data, stored.data) and torch.equal(loaded.scale, stored.scale)
        else:
            assert torch.equal(loaded, stored)
