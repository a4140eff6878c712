"""Which checkpoints count as complete, the Hugging Face names of our parameters (and which MoE
models no family holds), and how a straggler is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain import models
from pretrain.core.hf.llama import hf_name, hf_names
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.trainer.checkpoint.checkpointer import (
    DCP_METADATA,
    META,
    complete_checkpoints,
    find_checkpoint,
    step_dir,
)
from pretrain.trainer.checkpoint.export import ExportError, export
from pretrain.trainer.checkpoint.hf_tensors import to_hf
from pretrain.trainer.faults.step_guard import slowest_rank, stragglers


def make_checkpoint(root: Path, step: int, *, meta: bool = True, suffix: str = "") -> Path:
    path = step_dir(root, step)
    path = path.with_name(path.name + suffix)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"")
    if meta:
        (path / META).write_text("{}")
    return path


def test_only_renamed_checkpoints_with_metadata_count(tmp_path: Path) -> None:
    two = make_checkpoint(tmp_path, 2)
    ten = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 12, suffix=".tmp")  # crashed mid-save
    make_checkpoint(tmp_path, 14, meta=False)  # not marked complete
    assert complete_checkpoints(tmp_path) == [(2, two), (10, ten)]
    assert find_checkpoint(tmp_path) == ten
    assert find_checkpoint(tmp_path, step=2) == two
    assert find_checkpoint(tmp_path, step=12) is None


def test_a_run_without_checkpoints_has_none(tmp_path: Path) -> None:
    assert complete_checkpoints(tmp_path / "missing") == []
    assert find_checkpoint(tmp_path / "missing") is None


def test_every_parameter_has_a_distinct_hugging_face_llama_name() -> None:
    names = [name for name, _ in models.build(models.ModelConfig(n_layers=2)).named_parameters()]
    hf = [hf_name(name) for name in names]
    assert len(set(hf)) == len(names)
    assert hf_name("layers.1.attention.wk.weight") == "model.layers.1.self_attn.k_proj.weight"
    assert hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    ("times", "lag", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.5], 0.25, (3, 0.5)),
        ([1.0, 1.2, 1.0, 1.0], 0.25, None),
        ([2.0, 1.0, 1.0], 0.5, (0, 1.0)),
    ],
)
def test_the_slowest_rank_is_named_only_past_the_lag(times, lag, expected) -> None:
    found = slowest_rank(times, lag)
    if expected is None:
        assert found is None
    else:
        assert found[0] == expected[0]
        assert found[1] == pytest.approx(expected[1])


def test_stacked_experts_become_one_mixtral_tensor_per_expert() -> None:
    cfg = models.ModelConfig(n_layers=2, moe_experts=4, moe_ffn_dim=16)
    assert models.build(cfg).layers["1"].feed_forward.experts.w1.shape == (4, 16, cfg.dim)
    w1 = torch.randn(4, 16, cfg.dim)
    tensors = to_hf("layers.1.feed_forward.experts.w1", w1, cfg)
    prefix = "model.layers.1.block_sparse_moe.experts"
    assert list(tensors) == [f"{prefix}.{j}.w1.weight" for j in range(4)]
    assert all(torch.equal(tensors[f"{prefix}.{j}.w1.weight"], w1[j]) for j in range(4))
    assert hf_names("layers.0.feed_forward.router.weight", cfg) == [
        "model.layers.0.block_sparse_moe.gate.weight"
    ]


REFUSED = {
    "mixtral": (
        {"moe_layers": "after:1", "moe_normalize_topk": False},
        "MixtralForCausalLM",
        ["model.moe_layers=after:1: 1 of 4 layers are dense", "model.moe_normalize_topk=false"],
    ),
    "qwen2_moe": (
        {"moe_shared_experts": 1, "moe_router": "sigmoid", "moe_node_limit": 1},
        "Qwen2MoeForCausalLM",
        ["model.moe_router=sigmoid", "model.moe_node_limit=1: each token's experts come from"],
    ),
    "qwen3_moe": (
        {"qk_norm": True, "moe_shared_experts": 1, "moe_route_scale": 2.5},
        "Qwen3MoeForCausalLM",
        ["Qwen3-MoE (the MoE family with query/key norms) has no shared", "moe_route_scale=2.5"],
    ),
    "deepseek_v2": (
        {"attention": "mla", "moe_shared_experts": 1, "moe_balance": "bias"},
        "DeepseekV2ForCausalLM",
        ["model.norm_eps=1e-05: DeepSeek's latent norms", "model.moe_normalize_topk=true with",
         "model.moe_balance=bias: DeepSeek-V2's router has no balancing bias"],
    ),
}  # fmt: skip
"""A MoE model's options -> the family its options point to, and what keeps it out."""


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_moe_model_its_family_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, kind: str
) -> None:
    options, architecture, reasons = REFUSED[kind]
    cfg = RecipeConfig(name=kind)
    cfg.model.moe_experts = 8
    for field, value in options.items():
        setattr(cfg.model, field, value)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(cfg))
    with pytest.raises(ExportError) as err:
        export(tmp_path / "run", tmp_path / "hf")
    message = str(err.value)
    assert message.startswith(f"{kind} cannot be exported as a Hugging Face {architecture}:")
    assert all(reason in message for reason in reasons), message
    assert not (tmp_path / "hf").exists()


def test_a_mixtral_shaped_model_balanced_by_bias_is_refused_naming_the_bias(
    tmp_path: Path,
) -> None:
    cfg = RecipeConfig(name="mixtral_like")
    cfg.model.moe_experts, cfg.model.moe_balance = 4, "bias"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(cfg))
    with pytest.raises(ExportError, match=r"model\.moe_balance=bias: the per-expert"):
        export(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_stragglers_are_named_among_the_ranks_of_their_pipeline_stage() -> None:
    # Stage 1 (ranks 2, 3) computes twice as long as stage 0 by design: no straggler there.
    compute = [1.0, 1.0, 2.0, 2.1, 1.0, 1.6, 2.0, 2.0]
    stages = [0, 0, 1, 1, 0, 0, 1, 1]
    [(rank, lag)] = stragglers(compute, stages, lag=0.25)
    assert rank == 5 and lag == pytest.approx(0.6)
    assert stragglers([1.0, 9.0], [0, 1], lag=0.25) == []  # one rank per stage: no peers
    # Of two ranks, the slow one is compared with the other, not with their mean.
    assert stragglers([0.03, 0.33], [0, 0], lag=0.25) == [(1, pytest.approx(10.0))]
    # 40% more of a few milliseconds is measuring noise, not a straggler.
    assert stragglers([0.025, 0.025, 0.025, 0.035], [0] * 4, lag=0.25) == []


@pytest.mark.parametrize("target", ["model.safetensors", "model.safetensors/hf"])
def test_export_into_a_file_is_a_user_error_naming_the_path(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from pretrain.trainer.checkpoint.export import entry

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(RecipeConfig(name="tiny")))
    (tmp_path / "model.safetensors").write_bytes(b"mine")
    out = tmp_path / target
    monkeypatch.setattr("sys.argv", ["pretrain-export", str(tmp_path / "run"), str(out)])
    with pytest.raises(SystemExit) as ended:
        entry()  # refused before any checkpoint is looked for: the run has none
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain-export: {out}") and "is a file" in err
    assert (tmp_path / "model.safetensors").read_bytes() == b"mine"
