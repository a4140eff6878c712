"""Multi-token prediction: what each depth sees and predicts, its loss and how it joins the
objective, its place on the last pipeline stage, its size and FLOPs, and its rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pretrain import models
from pretrain.core.layout import resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import CheckpointConfig, ParallelConfig, RecipeConfig, dump_config
from pretrain.launcher.plan.memory import memory_breakdown, stage_params
from pretrain.launcher.plan.muon_work import block_matrices
from pretrain.models.flops import count_params, flops_per_token
from pretrain.models.init import init_weights
from pretrain.parallel.model_state import ModelState
from pretrain.parallel.pipeline.stages import StageView, split_stage
from pretrain.parallel.pipeline.tied_embedding import head_copies, mark_head_copy
from pretrain.trainer.checkpoint.checkpointer import Checkpointer, States
from pretrain.trainer.checkpoint.export import export
from pretrain.trainer.optim.optimizers import param_groups
from pretrain.trainer.step.chunked_loss import ChunkedLMLoss
from pretrain.trainer.step.mtp_loss import (
    IGNORED,
    MultiTokenLoss,
    lm_loss_sum,
    targets_ahead,
)
from pretrain.trainer.step.state import lm_loss
from tests.helpers import configure, problems

CFG = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, mtp_layers=2,
    max_seq_len=16,
)  # fmt: skip
B, S = 3, 12


def built(cfg: ModelConfig = CFG) -> torch.nn.Module:
    model = models.build(cfg)
    init_weights(model, seed=3)
    return model


def test_the_depths_follow_the_next_token_output_which_they_leave_unchanged() -> None:
    model = built()
    tokens = torch.randint(0, CFG.vocab_size, (B, S))
    out = model(tokens, mtp_tokens=tokens)
    assert out.shape == (3 * B, S, CFG.vocab_size)
    torch.testing.assert_close(out[:B], model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("depth", [1, 2])
def test_depth_k_at_position_i_reads_the_tokens_up_to_i_plus_k_and_no_further(depth: int) -> None:
    model = built()
    tokens = torch.randint(0, CFG.vocab_size, (1, S))
    i = 4
    base = model(tokens, mtp_tokens=tokens)[depth, i]
    beyond = tokens.clone()
    beyond[0, i + depth + 1 :] = (beyond[0, i + depth + 1 :] + 1) % CFG.vocab_size
    torch.testing.assert_close(model(beyond, mtp_tokens=beyond)[depth, i], base)
    ahead = tokens.clone()
    ahead[0, i + depth] = (ahead[0, i + depth] + 1) % CFG.vocab_size
    assert not torch.allclose(model(ahead, mtp_tokens=ahead)[depth, i], base)


def test_targets_ahead_are_rolled_left_with_the_wrapped_tail_left_out() -> None:
    targets = torch.arange(10).view(2, 5)
    assert targets_ahead(targets, 2).tolist() == [
        [2, 3, 4, IGNORED, IGNORED],
        [7, 8, 9, IGNORED, IGNORED],
    ]


def test_the_loss_reports_the_next_token_loss_and_trains_on_the_weighted_depths() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3 * B, S, 16, requires_grad=True)
    targets = torch.randint(0, 16, (B, S))
    loss = MultiTokenLoss(lm_loss, lm_loss_sum, depths=2, weight=0.3)(logits, targets)
    torch.testing.assert_close(loss, lm_loss(logits[:B], targets), rtol=0, atol=0)
    loss.backward()
    reference = logits.detach().clone().requires_grad_()
    # Depth k: the mean over the b (s - k) positions it has a target for.
    depths = [
        F.cross_entropy(reference[k * B : (k + 1) * B, : S - k].flatten(0, 1),
                        targets[:, k:].flatten())
        for k in (1, 2)
    ]  # fmt: skip
    (lm_loss(reference[:B], targets) + 0.3 * (depths[0] + depths[1]) / 2).backward()
    torch.testing.assert_close(logits.grad, reference.grad)


def test_each_depths_loss_is_recorded_for_the_step_and_forgotten_on_a_rerun() -> None:
    logits, targets = torch.randn(3 * B, S, 16), torch.randint(0, 16, (B, S))
    mtp = MultiTokenLoss(lm_loss, lm_loss_sum, depths=2, weight=0.3)
    mtp(logits, targets)
    mtp.drop_step()
    mtp.end_step()
    assert mtp._last is None
    mtp(logits, targets)
    mtp.end_step()
    expected = F.cross_entropy(logits[B : 2 * B, : S - 1].flatten(0, 1), targets[:, 1:].flatten())
    torch.testing.assert_close(mtp._last[0], expected)


def test_the_chunked_depth_loss_is_the_whole_one() -> None:
    model = built(dataclasses.replace(CFG, mtp_layers=1))
    model.head_in_loss = True
    tokens, targets = torch.randint(0, 64, (B, S)), torch.randint(0, 64, (B, S))
    hidden = model(tokens, mtp_tokens=tokens)
    chunked = MultiTokenLoss(
        ChunkedLMLoss(model.output, 4, lm_loss),
        ChunkedLMLoss(model.output, 4, lm_loss_sum, sums=True),
        depths=1,
        weight=1.0,
    )
    whole = MultiTokenLoss(lm_loss, lm_loss_sum, depths=1, weight=1.0)
    for loss in (chunked, whole):
        loss(hidden if loss is chunked else model.output(hidden), targets)
        loss.end_step()
    torch.testing.assert_close(chunked._last, whole._last)


def test_params_and_flops_count_the_mtp_modules() -> None:
    model = built()
    assert count_params(CFG).total == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, CFG.vocab_size, (B, S))
    counted = {}
    for cfg in (CFG, dataclasses.replace(CFG, mtp_layers=0)):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            built(cfg)(tokens, mtp_tokens=tokens)
        counted[cfg.mtp_layers] = counter.get_total_flops()
    assert counted[2] - counted[0] == flops_per_token(CFG, S).mtp * B * S


def test_the_last_stage_keeps_a_marked_copy_of_the_embedding_and_the_mtp_modules() -> None:
    parallel = ParallelConfig(pp=2)
    first, last = (split_stage(models.build(CFG), k, parallel) for k in (0, 1))
    for stage in (first, last):
        mark_head_copy(stage)
    assert first.mtp is None and last.mtp is not None
    assert head_copies(first) == [] and head_copies(last) == [last.tok_embeddings.weight]
    view = StageView([last])
    assert any(name.startswith("mtp.1.eh_proj") for name, _ in view.named_parameters())
    decay = {id(p) for g in param_groups(view, 0.1) if g["weight_decay"] for p in g["params"]}
    assert id(last.tok_embeddings.weight) not in decay
    tokens = torch.randint(0, CFG.vocab_size, (B, S))
    # The copy embeds the tokens ahead only: the stage's input is the hidden state.
    init_weights(last, seed=3)
    assert last(torch.randn(B, S, CFG.dim), mtp_tokens=tokens).shape == (3 * B, S, 64)


def test_the_plan_puts_the_mtp_modules_and_a_copy_of_the_embedding_on_the_last_stage() -> None:
    cfg = configure({"model.mtp_layers": 1, "parallel.pp": 2})
    plain = configure({"parallel.pp": 2})
    counts = count_params(cfg.model)
    mtp_blocks = stage_params(cfg, 1)[0] - stage_params(plain, 1)[0]
    assert mtp_blocks == counts.mtp
    assert stage_params(cfg, 1)[1] - stage_params(plain, 1)[1] == counts.embedding
    assert stage_params(cfg, 0) == stage_params(plain, 0)
    degrees = resolve_degrees(cfg)
    with_mtp = memory_breakdown(cfg, degrees, 4, 1)
    assert with_mtp.logits > 1.9 * memory_breakdown(plain, degrees, 4, 1).logits


def test_the_plans_mtp_matrices_are_the_ones_muon_updates() -> None:
    model = models.build(CFG)
    assert model.mtp is not None
    groups = param_groups(model.mtp["0"], 0.1, muon=True)
    got = sorted(tuple(p.shape) for g in groups if g["muon"] for p in g["params"])
    assert got == sorted(block_matrices(CFG, None)[0])


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        ({"model.mtp_layers": -1}, "model.mtp_layers", ">= 0"),
        ({"model.mtp_layers": 8, "train.seq_len": 8}, "model.mtp_layers", "no target"),
        ({"model.mtp_layers": 1, "model.mtp_loss_weight": -0.1}, "model.mtp_loss_weight", ">= 0"),
        ({"model.mtp_layers": 1, "parallel.cp": 2}, "model.mtp_layers", "context-parallel"),
        (
            {"model.mtp_layers": 1, "parallel.pp": 2, "parallel.vpp": 2,
             "parallel.pp_schedule": "zbv", "model.tie_embeddings": True},
            "model.mtp_layers", "a second weight of the same name",
        ),
        ({"model.mtp_layers": 2, "parallel.pp": 2, "parallel.pp_schedule": "zero_bubble"},
         "model.mtp_layers", "share the embedding and the head one after another"),
        ({"model.mtp_layers": 1, "parallel.pp": 2, "parallel.pp_schedule": "2bw"},
         "model.mtp_layers", "two weight versions"),
    ],
)  # fmt: skip
def test_mtp_is_refused_where_it_cannot_run(overrides: dict, field: str, says: str) -> None:
    found = [p for p in problems(configure(overrides)) if p.field == field]
    assert found and says in str(found[0])


def test_export_drops_the_mtp_modules_and_says_so(
    tmp_path, single_rank_group, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = RecipeConfig(name="mtp")
    cfg.model, cfg.data.tokenizer = CFG, "none"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    model = built()
    states = States(sharded={"model": ModelState(lambda: model)}, replicated={}, per_rank={})
    Checkpointer(run, CheckpointConfig(every=2), states, rank=0, world_size=1).save(2)
    out = export(run, tmp_path / "hf")
    names = set(load_file(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in names and not any("mtp" in n for n in names)
    assert "dropped the 2 multi-token prediction module(s)" in capsys.readouterr().out
