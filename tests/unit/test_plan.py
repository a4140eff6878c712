"""The plan: layout and rank groups, parameter counts, bubble, memory and step time."""

import dataclasses
import json
import math
import subprocess
import sys
from itertools import product

import pytest

from pretrain.core import hardware
from pretrain.core.hardware import GIB, gpu_spec
from pretrain.core.layout import Degrees, grad_accum_steps, rank_groups, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.cost import predicted_mfu, step_cost
from pretrain.launcher.plan.pipeline.schedule_sim import bubble_fraction
from pretrain.launcher.plan.plan import GROUPS_SHOWN, make_plan, plan_to_dict
from pretrain.launcher.plan.report.render import render_plan
from pretrain.launcher.validate.recipe import validate
from pretrain.models.flops import count_params, flops_per_token
from tests.helpers import LLAMA3_8B, LLAMA3_70B

LLAMA2_7B_SHAPE = ModelConfig(
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096
)


def recipe(
    model: ModelConfig, nodes: int = 1, gpus: int = 8, global_batch: int = 64, **parallel
) -> RecipeConfig:
    """A bf16 H100 recipe of `model` with the given parallel degrees; it must validate."""
    cfg = RecipeConfig(name="test", model=model)
    cfg.precision.dtype = "bf16"
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = nodes, gpus
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 4096, 1, global_batch
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    validate(cfg)
    return cfg


@pytest.mark.parametrize(("model", "expected"), [(LLAMA3_8B, 8.03e9), (LLAMA3_70B, 70.6e9)])
def test_shipped_llama3_sizes_have_their_published_parameter_counts(model, expected):
    plan = make_plan(recipe(model, nodes=2))
    assert plan.params_total == pytest.approx(expected, rel=0.01)


def test_world_16_groups_follow_the_mesh_pp_dp_replicate_dp_shard_cp_tp():
    degrees = resolve_degrees(recipe(LLAMA3_8B, nodes=2, tp=4, pp=2, dp_shard=1, cp=2))
    assert degrees == Degrees(pp=2, dp_replicate=1, dp_shard=1, tp=4, ep=1, world=16, cp=2)
    shape = degrees.mesh_shape

    def rank(p: int, r: int, s: int, c: int, t: int) -> int:  # row-major over the 5 dims
        return (((p * shape[1] + r) * shape[2] + s) * shape[3] + c) * shape[4] + t

    coords = list(product(*(range(n) for n in shape)))

    def along(dim: int) -> list[list[int]]:
        keys = sorted({c[:dim] + c[dim + 1 :] for c in coords})
        return [[rank(*k[:dim], i, *k[dim:]) for i in range(shape[dim])] for k in keys]

    groups = rank_groups(degrees)
    assert groups["tp"] == [list(range(start, start + 4)) for start in range(0, 16, 4)]
    for dim, name in enumerate(("pp", "dp_replicate", "dp_shard", "cp", "tp")):
        assert groups[name] == along(dim)
    assert groups["pp"][0] == [0, 8]
    assert groups["cp"][0] == [0, 4]
    assert groups["dp"] == groups["dp_shard"]
    # The cp ranks of a sequence share its gradient reduction with the dp ranks.
    assert groups["dp_cp"] == groups["cp"]


def test_dp_groups_span_both_data_parallel_dims_and_ep_splits_them():
    degrees = Degrees(pp=1, dp_replicate=2, dp_shard=4, tp=2, ep=2, world=16)
    groups = rank_groups(degrees)
    assert groups["dp"][0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert groups["ep"][:4] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    for name in ("tp", "dp", "ep"):  # every dim partitions the world
        assert sorted(r for g in groups[name] for r in g) == list(range(16))


def test_etp_splits_each_tp_group_into_consecutive_chunks():
    degrees = Degrees(pp=1, dp_replicate=1, dp_shard=2, tp=4, ep=2, world=8, etp=2)
    groups = rank_groups(degrees)
    assert groups["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_grad_accum_is_global_over_micro_batch_times_dp():
    cfg = recipe(LLAMA3_8B, nodes=2, tp=4)  # dp = 16 / 4 = 4
    assert grad_accum_steps(cfg) == 64 // (1 * 4)
    cfg.train.global_batch = 66
    with pytest.raises(RecipeError, match=r"train\.global_batch"):
        grad_accum_steps(cfg)


def test_plan_holds_tokens_flops_and_groups_of_the_recipe():
    cfg = recipe(LLAMA3_8B)
    cfg.recompute.policy = "selective"
    plan = make_plan(cfg)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    assert plan.tokens_per_step == 64 * 4096
    assert plan.flops_per_token_train == fpt.train == 3 * fpt.forward
    assert plan.flops_per_token_hardware == fpt.train + fpt.attention_scores
    assert plan.rank_group_counts["dp"] == 1 and plan.rank_groups["dp"] == [list(range(8))]


def test_huge_worlds_keep_the_first_groups_and_count_the_rest():
    plan = make_plan(recipe(LLAMA3_70B, nodes=512, global_batch=512, tp=8, pp=8))
    assert plan.degrees.world == 4096
    assert plan.rank_group_counts["tp"] == 512
    assert all(len(groups) <= GROUPS_SHOWN for groups in plan.rank_groups.values())


def test_stage_split_puts_embedding_first_and_head_last():
    cfg = recipe(LLAMA3_8B, tp=2, pp=2)
    plan = make_plan(cfg)
    counts = count_params(cfg.model)
    half = counts.per_layer * cfg.model.n_layers // 2
    assert plan.params_first_stage == counts.embedding + half
    assert plan.params_last_stage == half + counts.final_norm + counts.lm_head
    assert plan.params_first_stage + plan.params_last_stage == plan.params_total
    largest = max(plan.params_first_stage, plan.params_last_stage)
    assert plan.params_per_rank == math.ceil(largest / 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    assert bubble_fraction(schedule, pp=4, microbatches=8) == pytest.approx(3 / 11)


def test_interleaving_divides_the_idle_time_by_the_virtual_stages():
    # Idle (p-1)/v stage-times beside m busy ones: 1.5 / (8 + 1.5) of the step.
    assert bubble_fraction("interleaved_1f1b", pp=4, microbatches=8, vpp=2) == pytest.approx(
        1.5 / 9.5
    )


def test_zero_bubble_reports_the_1f1b_bound_and_says_so():
    cfg = recipe(LLAMA3_8B, pp=4, pp_schedule="zero_bubble")
    plan = make_plan(cfg)
    m = plan.pp_microbatches
    assert m == grad_accum_steps(cfg) == 64 // 2
    assert plan.bubble_fraction == pytest.approx(3 / (m + 3))
    assert any("zero_bubble" in note and "upper bound" in note for note in plan.assumptions)


def test_no_pipeline_has_no_bubble():
    assert make_plan(recipe(LLAMA3_8B)).bubble_fraction == 0.0


def test_mixed_precision_adamw_under_ddp_needs_16_bytes_per_parameter():
    plan = make_plan(recipe(LLAMA2_7B_SHAPE, gpus=4, zero=0))
    assert plan.model_states_by_zero[0].total / plan.params_per_rank == pytest.approx(16)


def test_zero_stages_shrink_model_states_as_the_zero_paper_says():
    # ZeRO (Rajbhandari et al. 2020), K = 12 bytes of optimizer state per parameter:
    # baseline (2 + 2 + K)Ψ; P_os: (2 + 2 + K/N)Ψ; P_os+g: (2 + (2 + K)/N)Ψ;
    # P_os+g+p: (2 + 2 + K)Ψ/N
    k, n = 12, 4
    expected = {1: (4 + k / n) / (4 + k), 2: (2 + (2 + k) / n) / (4 + k), 3: 1 / n}
    states = make_plan(recipe(LLAMA2_7B_SHAPE, gpus=n, zero=3)).model_states_by_zero
    for zero, ratio in expected.items():
        assert states[zero].total / states[0].total == pytest.approx(ratio)


def test_fp32_training_keeps_4_4_and_8_bytes_per_parameter():
    cfg = recipe(LLAMA2_7B_SHAPE, gpus=4)
    cfg.precision.dtype = "fp32"
    states = make_plan(cfg).model_states_by_zero[0]
    params = make_plan(cfg).params_per_rank
    assert (states.params / params, states.grads / params, states.optimizer / params) == (4, 4, 8)


def test_activations_follow_korthikanti_per_layer_formula():
    cfg = recipe(LLAMA2_7B_SHAPE)
    s, b, h, a, layers = 4096, 1, 4096, 32, 32
    logits = s * b * cfg.model.vocab_size * 4
    plan = make_plan(cfg)
    assert plan.activations - logits == pytest.approx(layers * s * b * h * (34 + 5 * a * s / h))
    cfg.recompute.policy = "selective"
    assert make_plan(cfg).activations - logits == pytest.approx(layers * s * b * h * 34)
    cfg.recompute.policy = "full"
    assert make_plan(cfg).activations - logits == pytest.approx(layers * 2 * s * b * h)


def test_sequence_parallelism_divides_activations_by_tp():
    without = make_plan(recipe(LLAMA2_7B_SHAPE, tp=8, dp_shard=1))
    with_sp = make_plan(recipe(LLAMA2_7B_SHAPE, tp=8, dp_shard=1, sp=True))
    logits = 4096 * 32000 * 4 / 8
    s, h, a = 4096, 4096, 32
    layer = s * h * (34 + 5 * a * s / h)
    assert with_sp.activations - logits == pytest.approx(32 * layer / 8)
    assert without.activations > with_sp.activations


def test_the_plans_step_time_and_mfu_are_the_cost_models_with_its_assumptions():
    cfg = recipe(LLAMA3_8B, tp=2, pp=2, zero=2)
    plan = make_plan(cfg)
    peak = gpu_spec("h100_sxm").peak_tflops["bf16"]
    links = hardware.links("h100_sxm")
    expected = step_cost(cfg, resolve_degrees(cfg), plan.pp_microbatches, peak, links)
    assert plan.step_time_s == expected.total and plan.step_cost == expected
    assert plan.mfu == predicted_mfu(cfg, expected.total, peak)
    assert plan.tokens_per_s == pytest.approx(plan.tokens_per_step / expected.total)
    assert plan.gpu_memory_gib == gpu_spec("h100_sxm").memory_gib
    text = render_plan(plan)
    assert f"{expected.total:.3g} s" in text and f"{plan.mfu:.1%}" in text
    assert "MFU" not in " ".join(plan.assumptions).replace("predicted MFU", "")
    assert any(note.startswith("step time: compute kernel by kernel") for note in plan.assumptions)


def test_cpu_ranks_have_no_step_time_and_no_memory_to_fit():
    cfg = RecipeConfig()
    cfg.cluster.device, cfg.cluster.gpus_per_node = "cpu", 2
    plan = make_plan(cfg)
    assert plan.step_time_s is None and plan.gpu_memory_gib is None and plan.peak_tflops is None


def test_a_model_that_does_not_fit_is_warned_about():
    plan = make_plan(recipe(LLAMA3_70B, zero=0))
    assert plan.memory_gib > 80
    assert any("exceeds the 80 GiB" in w for w in plan.warnings)
    assert plan.memory_gib == pytest.approx(
        (plan.model_states_by_zero[0].total + plan.activations) / GIB
    )


def test_json_output_round_trips():
    plan = make_plan(recipe(LLAMA3_8B, nodes=2, tp=2, pp=2, dp_replicate=2, zero=1))
    data = plan_to_dict(plan)
    assert json.loads(json.dumps(data)) == data
    assert data["degrees"]["dp"] == 4 and data["model_states_by_zero"]["zero1"]["total"] > 0


def test_rendered_table_shows_every_section():
    text = render_plan(make_plan(recipe(LLAMA3_8B, nodes=2, tp=4, pp=2)))
    for title in ("Plan: test", "Model", "Compute", "Memory per rank", "Fit and speed"):
        assert title in text
    assert f"{count_params(LLAMA3_8B).total:,}" in text
    assert "tp groups" in text and "[0,1,2,3]" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_planning_and_validation_do_not_import_torch():
    code = (
        "import sys, pretrain.launcher.plan.plan, pretrain.launcher.validate.recipe,"
        " pretrain.launcher.plan.report.render, pretrain.core.hardware;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_tied_model_under_pp_counts_the_last_stages_copy_of_the_embedding():
    tied = dataclasses.replace(LLAMA3_8B, tie_embeddings=True)
    cfg = recipe(tied, pp=2, zero=2)
    plan = make_plan(cfg)
    counts = count_params(tied)
    half = counts.per_layer * tied.n_layers // 2
    assert counts.lm_head == 0
    assert plan.params_first_stage == counts.embedding + half
    assert plan.params_last_stage == half + counts.final_norm + counts.embedding
    # Its gradient crosses between the two stages once per step: 4 B per parameter of
    # the embedding's dp shard (dp_shard=4), at 80% of the 450 GB/s the two ranks share.
    untied = make_plan(recipe(LLAMA3_8B, pp=2, zero=2))
    extra = 4 * counts.embedding / 4 / (450e9 * 0.8)
    assert plan.step_cost.pp_p2p - untied.step_cost.pp_p2p == pytest.approx(extra)
