"""Splitting the plain model into pipeline stages keeps names, weights and recompute choices."""

from __future__ import annotations

import dataclasses

import torch

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import ParallelConfig, RecomputeConfig
from pretrain.parallel.materialize import materialize
from pretrain.parallel.model_state import ModelState
from pretrain.parallel.pipeline.stages import StageView, split_stage
from pretrain.parallel.pipeline.tied_embedding import (
    EMBEDDING,
    HEAD,
    head_copies,
    mark_head_copy,
    reads_copy_from_embedding,
    renamed,
)
from pretrain.parallel.recompute import apply_recompute
from pretrain.trainer.optim.optimizers import param_groups

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)


def stages(parallel: ParallelConfig) -> list[torch.nn.Module]:
    count = parallel.pp * parallel.vpp
    return [split_stage(models.build(CFG), k, parallel) for k in range(count)]


def test_stages_hold_the_full_models_parameters_under_their_names_and_values() -> None:
    full = models.build(CFG)
    materialize(full, CFG, seed=7, device=torch.device("cpu"))
    parts = stages(ParallelConfig(pp=2, vpp=2, pp_layers=[1, 1, 1, 1]))
    names: list[str] = []
    for part in parts:
        materialize(part, CFG, seed=7, device=torch.device("cpu"))
        names += [name for name, _ in part.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in full.named_parameters())
    reference = dict(full.named_parameters())
    for part in parts:
        for name, param in part.named_parameters():
            assert torch.equal(param, reference[name]), name


def test_embedding_on_the_first_stage_and_head_on_the_last() -> None:
    first, middle, last = stages(ParallelConfig(pp=3, pp_layers=[1, 2, 1]))
    assert first.tok_embeddings is not None and first.output is None
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert last.tok_embeddings is None and last.output is not None
    assert list(middle.layers) == ["1", "2"]


def test_a_rank_view_of_its_chunks_keeps_full_model_names() -> None:
    parallel = ParallelConfig(pp=2, vpp=2)
    parts = stages(parallel)
    view = StageView([parts[0], parts[2]])  # rank 0 runs stages 0 and 2
    assert list(view.layers) == ["0", "2"]
    assert "tok_embeddings.weight" in dict(view.named_parameters())
    assert not any(name.startswith("output") for name, _ in view.named_parameters())


def test_a_stage_recomputes_the_blocks_the_full_model_would() -> None:
    recompute = RecomputeConfig(policy="full", every=2)  # blocks 1 and 3 of 0..3
    stage = stages(ParallelConfig(pp=2, pp_layers=[1, 3]))[1]  # layers 1, 2, 3
    plain_forward = type(stage.layers["1"]).forward
    apply_recompute(stage, recompute)
    wrapped = {key for key, block in stage.layers.items() if "forward" in vars(block)}
    assert wrapped == {"1", "3"}
    assert "forward" not in vars(stage.layers["2"])
    assert type(stage.layers["2"]).forward is plain_forward


def test_a_tied_heads_copy_on_the_last_stage_starts_as_the_embedding_and_never_decays() -> None:
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    full = models.build(tied)
    materialize(full, tied, seed=7, device=torch.device("cpu"))
    first, last = (split_stage(models.build(tied), k, ParallelConfig(pp=2)) for k in (0, 1))
    for stage in (first, last):
        materialize(stage, tied, seed=7, device=torch.device("cpu"))
        mark_head_copy(stage)
    assert head_copies(first) == [] and head_copies(last) == [last.output.weight]
    assert torch.equal(last.output.weight, full.tok_embeddings.weight)
    [decayed] = [g for g in param_groups(last, 0.1) if g["weight_decay"]]
    assert all(p is not last.output.weight for p in decayed["params"])


def test_a_stages_copy_of_a_tied_embedding_is_restored_from_the_embeddings_entries() -> None:
    # A checkpoint saved without PP holds the shared weight's optimizer states under the
    # embedding's name only; the last stage's copy reads the same tensors from there.
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    first, last = (split_stage(models.build(tied), k, ParallelConfig(pp=2)) for k in (0, 1))
    for stage in (first, last):
        mark_head_copy(stage)
    assert reads_copy_from_embedding(last) and not reads_copy_from_embedding(first)
    assert not reads_copy_from_embedding(models.build(tied))
    moments = {"exp_avg": torch.zeros(1)}
    optim = {"output.weight": moments, "norm.weight": {}}
    read = renamed(optim, HEAD, EMBEDDING)
    assert read == {"tok_embeddings.weight": moments, "norm.weight": {}}
    assert read["tok_embeddings.weight"] is moments
    assert renamed(read, EMBEDDING, HEAD) == optim
    # Under PP the model's own names are the full model's, so it reads the same entries.
    loaded = ModelState(lambda: last).state_dict_for_load()
    assert "tok_embeddings.weight" in loaded and "output.weight" not in loaded
