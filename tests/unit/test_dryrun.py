"""action=dryrun: one rank of a job built by the trainer's real code and stepped once under a
fake process group and fake tensors, compared with the plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pretrain.core.layout import grad_accum_steps
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.dryrun import (
    DryRunError,
    comparisons,
    fullest_rank,
    measured_recipe,
    rank_plan,
    refusal,
    run_dry_run,
    traffic_comparisons,
)
from pretrain.launcher.plan.plan import make_plan
from tests.helpers import compose_recipe, pretrain

TOLERANCE = 0.10


def small_tp_fsdp(n_heads: int = 8) -> RecipeConfig:
    """8 ranks: tp=2 with sequence parallelism inside, ZeRO-2 over 4 data-parallel ranks."""
    cfg = RecipeConfig(name="small")
    cfg.model = ModelConfig(
        vocab_size=512, dim=256, n_layers=2, n_heads=n_heads, n_kv_heads=n_heads // 2,
        ffn_dim=512, max_seq_len=128,
    )  # fmt: skip
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 128, 1, 8
    cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.zero = 2, True, 2
    cfg.cluster.device, cfg.cluster.gpu_type, cfg.cluster.gpus_per_node = "cpu", "cpu", 8
    return cfg


def test_a_tp_plan_that_does_not_divide_the_heads_fails_the_dry_run_naming_rank_and_shape():
    cfg = small_tp_fsdp()
    # 6 heads of 64 over tp=4: each rank's query projection holds 96 columns, 1.5 heads.
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.dim = 6, 6, 384
    cfg.parallel.tp = 4
    with pytest.raises(DryRunError) as error:
        run_dry_run(cfg, 3)
    assert error.value.rank == 3
    assert "the dry run of rank 3 failed" in str(error.value)
    assert "shape" in error.value.reason


def test_a_rank_outside_the_job_is_refused_before_anything_runs():
    with pytest.raises(DryRunError, match=r"dryrun.rank=8: the job has ranks 0 to 7"):
        run_dry_run(small_tp_fsdp(), 8)


def small_pipeline() -> RecipeConfig:
    """4 ranks: pp=2 (1F1B, two layers a stage) x ZeRO-2 over 2 data-parallel ranks, bf16."""
    cfg = small_tp_fsdp()
    cfg.model.n_layers = 4
    cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.sp = 2, 1, False
    cfg.precision.dtype, cfg.cluster.gpus_per_node = "bf16", 4
    return cfg


def test_the_last_stage_of_a_pipedream_2bw_layout_steps_within_ten_percent_of_its_plan():
    """Rank 2: the last stage (pp is the outermost mesh dim), with the head and the loss,
    compared with the plan of its own stage (the plan's own peak is the fullest stage's).
    PipeDream-2BW: two weight versions, and the step measured is the second, which runs the
    first's last backwards beside its own and applies the first's gradient."""
    cfg = small_pipeline()
    cfg.parallel.pp_schedule = "2bw"
    rank = 2
    result = run_dry_run(cfg, rank)
    assert result["coordinates"]["pp"] == 1
    figures = {c.name: c for c in comparisons(rank_plan(cfg, make_plan(cfg), rank), result)}
    for name in ("parameters", "optimizer states", "peak of later steps"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name
    # Gradients back to the first stage, one [1, 128, 256] bf16 tensor per micro-batch, and
    # nothing else: the shapes were given, not sent.
    hidden = cfg.train.seq_len * cfg.model.dim * 2 * result["micro_batches"]
    assert result["collectives"]["send"] == hidden
    # Without accumulation, FSDP gathers and reduce-scatters for every micro-batch.
    traffic = {c.name: c for c in traffic_comparisons(cfg, result)}
    for kind in ("all_gather", "reduce_scatter", "send", "recv"):
        assert traffic[kind].ratio == pytest.approx(1.0, abs=0.01), kind


def test_a_failing_rank_of_a_pipelined_layout_is_named():
    cfg = small_pipeline()
    # 6 heads of 64 over tp=4: each rank's query projection holds 96 columns, 1.5 heads.
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.dim = 6, 6, 384
    cfg.parallel.tp, cfg.cluster.gpus_per_node = 4, 8
    with pytest.raises(DryRunError) as error:
        run_dry_run(cfg, 6)  # the second stage
    assert error.value.rank == 6
    assert "the dry run of rank 6 failed" in str(error.value)
    assert "shape" in error.value.reason


def test_a_stage_given_wrong_shapes_fails_the_dry_run(monkeypatch):
    """torch checks every stage's tensors against the shapes it was given, so a shape the
    recipe derives wrongly fails the dry run instead of going unnoticed."""
    from pretrain.parallel.pipeline.shapes import stage_shapes
    from pretrain.trainer.dryrun.run import DryRunFailure, dry_run
    from pretrain.trainer.step import pipeline

    def too_wide(cfg, *args):
        return replace(stage_shapes(cfg, *args), dim=cfg.model.dim * 2)

    monkeypatch.setattr(pipeline, "stage_shapes", too_wide)
    with pytest.raises(DryRunFailure, match=r"running the training step: .*Stage 0 forward"):
        dry_run(small_pipeline(), 0)


def test_the_dry_run_holds_the_states_and_issues_the_collectives_the_plan_counts():
    """tp2 with SP under selective recompute, which keeps the row-parallel projections'
    reduce-scattered outputs: its recomputation gathers the inputs again and reduces no
    output again, as the cost model counts (the old policy, which kept the partial sums,
    reduce-scattered the attention's output again: 20% more)."""
    cfg = small_tp_fsdp()
    cfg.recompute.policy = "selective"
    result = run_dry_run(cfg, fullest_rank(cfg))
    figures = {c.name: c for c in comparisons(make_plan(cfg), result)}
    for name in ("parameters", "optimizer states"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name
    # Two micro-batches per data-parallel rank: 8 sequences over 4.
    assert result["micro_batches"] == 2
    traffic = {c.name: c for c in traffic_comparisons(cfg, result)}
    for kind in ("all_gather", "reduce_scatter"):
        assert traffic[kind].ratio == pytest.approx(1.0, abs=0.01), kind
    # The rest are the step's scalars and the loss's sums: a few KB.
    assert traffic["all_reduce"].measured_bytes < 2**14


def test_plan_format_json_holds_the_dry_run_of_a_ddp_layout_beside_the_plan(tmp_path):
    """tiny as shipped: DDP over 2 ranks, whose start-up would read the weights' values."""
    done = pretrain(
        "--config-name", "tiny", "action=dryrun", "plan.format=json", "model.n_layers=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    dry = out["dryrun"]
    assert {"rank", "peak_gib", "plan_peak_gib", "collectives"} <= set(dry)
    assert dry["rank"] == 0 and dry["peak_gib"] > 0
    # Beside the bytes counted, the cost model's: for the micro-batches run, and the step's.
    assert dry["plan_collectives"]["all_reduce"] > 0
    assert dry["plan_step_collectives"]["all_reduce"] >= dry["plan_collectives"]["all_reduce"]
    figures = {c["name"]: c["ratio"] for c in dry["comparison"]}
    for name in ("parameters", "optimizer states", "peak of later steps"):
        assert figures[name] == pytest.approx(1.0, abs=TOLERANCE), name
    # Every fp32 gradient all-reduced once in the step (not once per micro-batch), besides
    # a few scalars (the grad norm, the bad-step agreement).
    grads = dry["built"]["Parameter"]
    assert dry["collectives"]["all_reduce"] == pytest.approx(grads, rel=1e-3)
    assert not list(tmp_path.iterdir()), "a dry run writes no file"


@pytest.mark.slow
def test_llama3_70b_at_its_recipe_layout_steps_within_ten_percent_of_its_plan():
    """Full size, dense with PP and TP: tp=8 with SP, 4 pipeline stages under 1F1B, ZeRO-2
    over 2, 8,192-token sequences, selective recompute; four micro-batches, one per stage,
    which puts on each stage as many in flight as the step's full accumulation would. The
    fullest rank, by the plan, of the rank's own stage; every collective kind as the cost
    model counts it."""
    cfg = compose_recipe("llama3_70b", ["train.global_batch=8"])
    rank = fullest_rank(cfg)
    result = run_dry_run(cfg, rank)
    figures = {c.name: c for c in comparisons(rank_plan(cfg, make_plan(cfg), rank), result)}
    for name in ("parameters", "optimizer states", "peak of later steps"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name
    for c in traffic_comparisons(cfg, result):
        if c.measured_bytes > 2**20:  # beside the step's scalars
            assert c.ratio == pytest.approx(1.0, abs=TOLERANCE), c.name


def test_a_dry_run_runs_two_micro_batches_per_rank_or_one_per_pipeline_stage():
    """The step's peak is reached by its second micro-batch (a pipeline's once every stage
    holds what it holds in flight), so the rest are not run; GPipe holds them all."""
    cfg = compose_recipe("llama3_8b", [])  # 64 micro-batches per rank
    cut = measured_recipe(cfg)
    assert grad_accum_steps(cut) == 2 and grad_accum_steps(cfg) == 64
    assert cut.parallel == cfg.parallel and cut.model == cfg.model
    pipelined = measured_recipe(compose_recipe("llama3_70b", []))
    assert grad_accum_steps(pipelined) == 4  # one per stage of pp=4
    gpipe = compose_recipe("llama3_70b", ["parallel.pp_schedule=gpipe"])
    assert measured_recipe(gpipe) is gpipe


def test_plan_dryrun_refuses_a_submission_whose_dry_run_fails_naming_rank_and_reason():
    cfg = small_tp_fsdp()
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.dim = 6, 6, 384
    cfg.parallel.tp, cfg.dryrun.rank = 4, 5
    refused = refusal(cfg, make_plan(cfg))
    assert refused is not None
    assert refused.startswith("Recipe 'small' is refused: the dry run of rank 5 failed:")


def test_a_dropless_expert_parallel_layout_under_selective_recompute_steps():
    """A block's recomputation issues the ops its forward did, though the dispatch's slot
    bound has seen that forward's load by then."""
    cfg = compose_recipe(
        "tiny_moe",
        ["parallel.ep=2", "parallel.zero=2", "recompute=selective", "train.global_batch=8"],
    )
    result = run_dry_run(cfg, 1)
    assert result["collectives"]["all_to_all"] > 0


@pytest.mark.slow
def test_mixtral_8x7b_at_its_recipe_layout_steps_within_the_planned_peak():
    """Full size, MoE: 8 experts over ep=8, ZeRO-3 over 16 ranks, full recompute (two
    micro-batches of the step's 16). Every category's peak: plan / dry run was 1.02."""
    cfg = compose_recipe("mixtral_8x7b", ["train.global_batch=32"])
    result = run_dry_run(cfg, fullest_rank(cfg))
    figures = {c.name: c for c in comparisons(make_plan(cfg), result)}
    for name in ("parameters", "optimizer states", "peak of later steps"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name
    for c in traffic_comparisons(cfg, result):
        if c.measured_bytes > 2**20:  # beside the step's scalars
            assert c.ratio == pytest.approx(1.0, abs=TOLERANCE), c.name
    assert result["collectives"]["all_to_all"] > 0


@pytest.mark.slow
def test_latent_attention_moe_layers_under_selective_recompute_peak_where_the_plan_says():
    """DeepSeek-V2-Lite's block shapes, narrowed (12 layers), on a CUDA job. Selective
    recompute keeps the router's and the shared experts' matmul outputs, not the routed
    experts' grouped GEMMs; MLA's value heads are narrower than its query heads, which the
    CPU's fused attention cannot run, so the dry run runs the kernel CUDA picks (no score
    matrix). Plan / dry run was 0.69 while the plan counted the grouped GEMMs' outputs and the
    dry run the CPU's score matrices."""
    narrow = [
        "model.vocab_size=4096", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=8",
        "model.mla_kv_rank=128", "model.ffn_dim=1024", "model.moe_ffn_dim=256",
        "model.n_layers=12", "train.seq_len=2048", "model.max_seq_len=2048",
        "train.global_batch=16",
    ]  # fmt: skip
    cfg = measured_recipe(compose_recipe("deepseek_v2_lite", narrow))
    result = run_dry_run(cfg, 0)
    figures = {c.name: c for c in comparisons(rank_plan(cfg, make_plan(cfg), 0), result)}
    for name in ("parameters", "optimizer states", "peak of later steps"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name


def test_the_mtp_modules_norms_and_projection_are_whole_on_every_tp_rank_as_planned():
    """parallel/tensor.py leaves each depth's norms and its projection of [embedding; hidden]
    whole on every tp rank; the plan counts them so (it split them over tp before)."""
    cfg = small_tp_fsdp()
    cfg.model.mtp_layers = 1
    result = run_dry_run(cfg, 0)
    figures = {c.name: c for c in comparisons(make_plan(cfg), result)}
    assert figures["parameters"].ratio == pytest.approx(1.0, abs=0.01)


def test_a_first_stage_running_every_forward_first_peaks_after_its_first_backward():
    """Two stages under 1F1B with two micro-batches, ZeRO-2 over 2: the first stage runs both
    forwards before a backward, and its peak comes after the first backward, which leaves
    the unsharded FP32 gradients beside the other micro-batch's activations. The plan
    counted the end of the forwards, without gradients (that category was 0.47)."""
    cfg = small_tp_fsdp()
    cfg.model.n_layers, cfg.cluster.gpus_per_node = 4, 4
    cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.pp = 1, False, 2
    cfg.train.global_batch = 4
    cfg = measured_recipe(cfg)
    result = run_dry_run(cfg, 0)
    figures = {c.name: c for c in comparisons(rank_plan(cfg, make_plan(cfg), 0), result)}
    for name in ("grads, weight copies, temporaries", "peak of later steps"):
        assert figures[name].ratio == pytest.approx(1.0, abs=TOLERANCE), name
