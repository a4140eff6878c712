"""Expert tensor parallelism (parallel.etp): the trainer's real build of one rank splits each
expert's hidden width over etp (w1/w3 by column, w2 by row) beside ep's split of the experts
and ZeRO's of the model width, and sums the slices' outputs over the etp group."""

from __future__ import annotations

import torch

from pretrain.core.layout import resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate
from pretrain.models.moe import WholeExperts, moe_modules

N, H, F = 8, 32, 64


def recipe(etp: int, zero: int) -> RecipeConfig:
    cfg = RecipeConfig(name="etp")
    cfg.model = ModelConfig(
        vocab_size=512, dim=H, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=32,
        moe_experts=N, moe_top_k=2, moe_ffn_dim=F,
    )  # fmt: skip
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 32, 1, 8
    cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.etp, cfg.parallel.zero = 2, 2, etp, zero
    cfg.cluster.gpus_per_node = 8  # dp = 4: two ranks hold the same experts (edp = 2)
    cfg.cluster.device, cfg.cluster.gpu_type = "cpu", "cpu"
    validate(cfg, for_launch=True)
    return cfg


def build_rank(cfg: RecipeConfig, rank: int) -> torch.nn.Module:
    """The plain model of `rank`, built by the trainer under fake tensors and collectives."""
    from pretrain.parallel.mesh import build_mesh
    from pretrain.trainer.build import build_model
    from pretrain.trainer.dryrun.fake import fake_tensors, fake_world

    with fake_world(rank, cfg.cluster.gpus_per_node):
        mesh = build_mesh(resolve_degrees(cfg), "cpu")
        with fake_tensors():
            _, plain = build_model(cfg, mesh, torch.device("cpu"))
    return plain


def local_shapes(plain: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    [moe] = moe_modules(plain)
    return {name: tuple(p.to_local().shape) for name, p in moe.experts.named_parameters()}


def test_etp_splits_each_experts_hidden_width_and_zero_the_model_width() -> None:
    plain = build_rank(recipe(etp=2, zero=3), rank=5)
    # ep halves the experts, etp the hidden width F, ZeRO-3 over edp = 2 the model width H.
    assert local_shapes(plain) == {
        "w1": (N // 2, F // 2, H // 2),
        "w3": (N // 2, F // 2, H // 2),
        "w2": (N // 2, H // 2, F // 2),
    }
    [moe] = moe_modules(plain)
    assert type(moe.experts_split) is not WholeExperts
    assert moe.experts_split.mesh.size() == 2


def test_without_etp_every_tp_rank_holds_its_experts_whole() -> None:
    plain = build_rank(recipe(etp=1, zero=0), rank=5)
    assert local_shapes(plain)["w1"] == (N // 2, F, H)
    [moe] = moe_modules(plain)
    assert type(moe.experts_split) is WholeExperts
