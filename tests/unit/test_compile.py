"""Compile per block and the loss: names stay, numerics stay, failures are named."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo import register_backend

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import CompileConfig, RecomputeConfig
from pretrain.parallel.compile import CompileError, GuardedCompile, apply_compile, compile_loss
from pretrain.parallel.materialize import materialize
from pretrain.parallel.recompute import apply_recompute
from pretrain.trainer.step.state import lm_loss

MODEL = ModelConfig(
    vocab_size=128, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32
)


@register_backend(name="fails_for_tests")
def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend refuses every graph")


MOE_MODEL = dataclasses.replace(MODEL, moe_experts=4, moe_top_k=2)


def built(
    compile_cfg: CompileConfig | None = None,
    recompute: str = "none",
    cfg: ModelConfig = MODEL,
    context_parallel: bool = False,
) -> torch.nn.Module:
    model = models.build(cfg)
    apply_recompute(model, RecomputeConfig(policy=recompute))
    if compile_cfg is not None:
        apply_compile(model, compile_cfg, context_parallel)
    materialize(model, cfg, seed=3, device=torch.device("cpu"))
    return model


def loss_and_grads(model: torch.nn.Module, loss_fn=lm_loss) -> tuple[float, dict]:
    tokens = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def test_compiled_blocks_keep_the_plain_parameter_names():
    plain = built()
    compiled = built(CompileConfig(enabled=True, backend="aot_eager"))
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert all(isinstance(b.forward, GuardedCompile) for b in compiled.layers.values())


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compiled_blocks_and_loss_match_eager_in_fp32(recompute):
    cfg = CompileConfig(enabled=True, backend="aot_eager")
    eager_loss, eager_grads = loss_and_grads(built(recompute=recompute))
    loss, grads = loss_and_grads(built(cfg, recompute=recompute), compile_loss(lm_loss, cfg))
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_block_with_routed_experts_compiles_its_attention_and_matches_eager(recompute):
    """The experts' dispatch (data-dependent sizes, the recompute query, in-place routing
    statistics) cannot be one graph: such a block compiles its attention alone."""
    cfg = CompileConfig(enabled=True, backend="aot_eager")
    eager_loss, eager_grads = loss_and_grads(built(recompute=recompute, cfg=MOE_MODEL))
    model = built(cfg, recompute=recompute, cfg=MOE_MODEL)
    assert all(isinstance(b.attention.forward, GuardedCompile) for b in model.layers.values())
    assert not any(isinstance(b.forward, GuardedCompile) for b in model.layers.values())
    loss, grads = loss_and_grads(model, compile_loss(lm_loss, cfg))
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_under_context_parallelism_a_block_compiles_its_feed_forward_and_matches_eager(recompute):
    """The ring attention's point-to-point exchange cannot be traced: it stays eager (the
    ring itself is trained by tests/distributed/test_pairwise_matrix.py's cp + compile case)."""
    cfg = CompileConfig(enabled=True, backend="aot_eager")
    eager_loss, eager_grads = loss_and_grads(built(recompute=recompute))
    model = built(cfg, recompute=recompute, context_parallel=True)
    for block in model.layers.values():
        assert isinstance(block.feed_forward.forward, GuardedCompile)
        assert not isinstance(block.forward, GuardedCompile)
        assert not isinstance(block.attention.forward, GuardedCompile)
    loss, grads = loss_and_grads(model)
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    moe = built(cfg, cfg=MOE_MODEL, context_parallel=True)
    assert not any(
        isinstance(m.forward, GuardedCompile) for b in moe.layers.values() for m in b.modules()
    )


def test_compile_off_or_nothing_selected_leaves_forward_and_loss_alone():
    model = built(CompileConfig(enabled=False))
    assert all(not isinstance(b.forward, GuardedCompile) for b in model.layers.values())
    assert compile_loss(lm_loss, CompileConfig(enabled=False)) is lm_loss
    assert compile_loss(lm_loss, CompileConfig(enabled=True, loss=False)) is lm_loss


def test_a_block_that_fails_to_compile_is_named_and_stops_the_run():
    model = built(CompileConfig(enabled=True, backend="fails_for_tests"))
    with pytest.raises(CompileError, match=r"block layers\.0 .*compile\.fallback=true"):
        loss_and_grads(model)


def test_with_fallback_a_failed_block_runs_eagerly_and_says_so(capfd):
    eager_loss, _ = loss_and_grads(built())
    cfg = CompileConfig(enabled=True, backend="fails_for_tests", fallback=True)
    model = built(cfg)
    loss, _ = loss_and_grads(model, compile_loss(lm_loss, cfg))
    assert loss == eager_loss
    log = capfd.readouterr().err
    for name in ("block layers.0", "block layers.1", "block layers.2", "the loss"):
        assert f"[compile] {name} failed to compile" in log
    assert "running it eagerly because compile.fallback=true" in log
    assert all(b.forward.fell_back for b in model.layers.values())
