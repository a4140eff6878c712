"""train.loss_chunks: the LM head and loss in sequence chunks give the loss and gradients of
the whole logits, and never hold the whole logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.core.model_config import ModelConfig
from pretrain.launcher.plan.memory_fit import predict
from pretrain.models.init import init_weights
from pretrain.models.llama import Transformer, build_on_meta
from pretrain.trainer.step.chunked_loss import ChunkedLMLoss
from pretrain.trainer.step.state import lm_loss
from tests.helpers import configure, problems

TINY = ModelConfig(
    vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
)


def _model(cfg: ModelConfig = TINY) -> Transformer:
    model = build_on_meta(cfg)
    init_weights(model, seed=0)
    return model


def _loss_and_grads(model: Transformer, chunks: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (3, 33), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model.zero_grad(set_to_none=True)
    model.head_in_loss = chunks > 1
    out = model(inputs)
    loss = ChunkedLMLoss(model.output, chunks, lm_loss)(out, targets) if chunks > 1 else None
    loss = lm_loss(out, targets) if loss is None else loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_matches_the_whole_logits_loss_and_gradients(tied: bool) -> None:
    model = _model(dataclasses.replace(TINY, tie_embeddings=tied))
    whole, whole_grads = _loss_and_grads(model, 1)
    for chunks in (2, 8):
        loss, grads = _loss_and_grads(model, chunks)
        assert abs(loss.item() - whole.item()) <= 1e-6 * whole.item()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, whole_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_no_more_than_one_chunk_of_logits_is_ever_allocated() -> None:
    model = _model()
    model.head_in_loss = True
    inputs = torch.randint(0, TINY.vocab_size, (2, 32))
    sizes: list[int] = []

    # The positions of every logits-like tensor forward and backward create (the head's
    # weight, transposed for the matmul, is not one).
    class Widths(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
            if (
                len(shape) >= 2
                and shape[-1] == TINY.vocab_size
                and shape != (TINY.dim, TINY.vocab_size)
            ):
                sizes.append(out.numel() // TINY.vocab_size)
            return out

    with Widths():
        loss = ChunkedLMLoss(model.output, 4, lm_loss)(model(inputs), inputs)
        loss.backward()
    assert sizes and max(sizes) == 2 * 32 // 4


def test_loss_chunks_must_divide_the_sequence() -> None:
    (problem,) = problems(configure({"train.loss_chunks": 3}))
    assert problem.field == "train.loss_chunks"
    assert "does not divide train.seq_len=256" in problem.reason
    assert "4" in problem.fix
    (problem,) = problems(configure({"train.loss_chunks": 0}))
    assert problem.field == "train.loss_chunks"


def test_the_planner_counts_one_chunk_of_logits() -> None:
    whole, chunked = configure({}), configure({"train.loss_chunks": 4})
    for cfg in (whole, chunked):
        cfg.model.vocab_size = 128256
    assert predict(chunked).logits == pytest.approx(predict(whole).logits / 4)
    assert predict(chunked).total < predict(whole).total
