"""A compiled step compiles its graphs in the first step and nothing after: dynamo's counters
after three training steps of the trainer's own state, in one process (the TP and FSDP
layouts are checked in their compiled launch, tests/distributed/test_compile_parity.py)."""

from __future__ import annotations

import pytest
import torch

from pretrain.core.layout import resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.compile import compile_counts
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.faults.step_guard import StepGuard
from pretrain.trainer.observe.compile_watch import CompileWatch
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import LocalStep, eval_loss


def recipe(*, doc_mask: bool, loss_chunks: int) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model = ModelConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32
    )
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 32, 2, 4
    cfg.train.loss_chunks = loss_chunks
    cfg.data.doc_mask = doc_mask
    cfg.compile.enabled = True
    # Graphs, guards and graph breaks are dynamo's, whichever backend compiles the graphs:
    # the eager backend runs them as traced, so the test takes seconds, not minutes.
    cfg.compile.backend = "eager"
    cfg.cluster.device = "cpu"
    return cfg


def micro_batches(cfg: RecipeConfig, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch, cfg.train.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])] * (cfg.train.global_batch // cfg.train.micro_batch)


@pytest.mark.parametrize(
    ("doc_mask", "loss_chunks"),
    [
        pytest.param(False, 1, id="default"),
        # The same graphs with a mask input and the loss under checkpointed chunks: a few
        # seconds more, so in the slow tier.
        pytest.param(True, 4, id="doc_mask_chunked_loss", marks=pytest.mark.slow),
    ],
)
def test_three_compiled_steps_break_no_graph_and_recompile_nothing_after_the_first(
    single_rank_group, doc_mask, loss_chunks
):
    torch._dynamo.reset()
    cfg = recipe(doc_mask=doc_mask, loss_chunks=loss_chunks)
    degrees = resolve_degrees(cfg)
    device = torch.device("cpu")
    state = build_train_state(cfg, build_mesh(degrees, "cpu"), device)
    guard = StepGuard(cfg.faults.max_bad_steps, device, cfg.faults)
    ctx = StepContext(state, cfg, degrees, device, guard=guard, doc_eos=0 if doc_mask else None)
    stepper, watch = LocalStep(ctx), CompileWatch(enabled=True)

    counts = []
    for seed in range(3):
        watch.step(lambda seed=seed: stepper.step(micro_batches(cfg, seed)))
        counts.append(compile_counts())

    assert counts[0].graphs > 0 and counts[0].seconds > 0
    assert [c.graph_breaks for c in counts] == [0, 0, 0]
    assert [c.graphs for c in counts] == [counts[0].graphs] * 3
    assert watch.metrics()["compile_recompiles"] == 0
    # An evaluation runs without gradients: one graph more, not a training step's recompile.
    eval_loss(ctx, micro_batches(cfg, 3))
    watch.step(lambda: stepper.step(micro_batches(cfg, 4)))
    assert watch.metrics()["compile_recompiles"] == 0


def test_a_step_that_compiles_again_is_counted_as_a_recompile(single_rank_group):
    torch._dynamo.reset()
    watch = CompileWatch(enabled=True)
    double = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
    watch.step(lambda: double(torch.ones(2)))
    watch.step(lambda: double(torch.ones(2)))
    watch.step(lambda: double(torch.ones(3)))  # another shape: its guard fails
    assert watch.metrics()["compile_recompiles"] == 1
    assert CompileWatch(enabled=False).metrics() == {}
