"""Precision rules: FP8 and FP16 recipes that cannot run are refused before launch, with a fix."""

import pytest

from pretrain.core.precision import backend_installed, peak_dtype
from pretrain.launcher.plan.plan import make_plan
from pretrain.launcher.validate.recipe import validate
from tests.helpers import configure, problems

FP8_GPU = {"precision.dtype": "fp8", "cluster.backend": "slurm"}
"""FP8 on the base recipe's H100s; slurm, so whether a backend is installed here is not asked."""
FP8_CPU = {**FP8_GPU, "cluster.device": "cpu", "cluster.gpu_type": "cpu"}
EMULATED = {**FP8_CPU, "precision.fp8_emulate": True}
MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_ffn_dim": 256}

# (overrides, field, words of the reason, words of the fix)
CASES = [
    ({**FP8_CPU}, "precision.dtype", "FP8 needs a CUDA GPU (cluster.device=cpu)",
     "precision.fp8_backend=torchao precision.fp8_emulate=true"),
    ({**FP8_CPU, "precision.fp8_backend": "te"}, "precision.dtype", "FP8 needs a CUDA GPU",
     "fp8_emulate=true"),
    ({**FP8_CPU, "precision.fp8_backend": "te", "precision.fp8_emulate": True},
     "precision.fp8_emulate", "only torchao can emulate FP8", "precision.fp8_backend=torchao"),
    ({**FP8_GPU, "cluster.gpu_type": "a100_sxm_80gb"}, "precision.dtype",
     "a100_sxm_80gb has no FP8 tensor cores (compute capability 8.0 < 8.9)", "use bf16"),
    ({**FP8_GPU, "cluster.gpu_type": "v100_sxm_32gb"}, "precision.dtype",
     "compute capability 7.0 < 8.9", "fp16 below 8.0"),
    ({**FP8_GPU, "precision.fp8_backend": "te", "precision.fp8_recipe": "mxfp8"},
     "precision.fp8_recipe", "MXFP8 needs compute capability >= 10.0", "current or delayed"),
    ({**FP8_GPU, "precision.fp8_recipe": "delayed"}, "precision.fp8_recipe",
     "fp8_backend=torchao has no 'delayed' scaling",
     "use current, rowwise, mxfp8 or blockwise, or precision.fp8_backend=te"),
    ({**FP8_GPU, "precision.fp8_backend": "te", "precision.fp8_recipe": "rowwise"},
     "precision.fp8_recipe", "fp8_backend=te has no 'rowwise'", "precision.fp8_backend=torchao"),
    ({**FP8_GPU, "precision.fp8_backend": "apex"}, "precision.fp8_backend", "unknown value",
     "use torchao or te"),
    ({**FP8_GPU, "model.ffn_dim": 1000}, "model.ffn_dim",
     "FP8 matmuls need multiples of 16; the width is 1000", "multiple of 16"),
    ({**FP8_GPU, "model.dim": 520, "model.n_heads": 8, "model.n_kv_heads": 8},
     "model.dim", "the width is 520", "or precision.dtype=bf16"),
    ({**FP8_GPU, "model.dim": 256, "model.n_heads": 32, "model.n_kv_heads": 1},
     "model.n_kv_heads", "key/value width (n_kv_heads x head_dim) is 8", "multiple of 16"),
    ({**FP8_GPU, "train.seq_len": 255, "train.micro_batch": 1}, "train.micro_batch",
     "(micro_batch x seq_len = 255)", "a multiple of 16"),
    ({**FP8_GPU, "precision.fp8_backend": "te", "parallel.tp": 2}, "parallel.tp",
     "Transformer Engine FP8 with tensor parallelism", "fp8_backend=torchao"),
    ({**FP8_GPU, "precision.fp8_all_gather": True}, "precision.fp8_all_gather",
     "under FSDP (ZeRO-2/3); parallel.zero=0", "parallel.zero=2 or 3"),
    ({**FP8_GPU, "precision.fp8_all_gather": True, "parallel.zero": 3,
      "precision.fp8_recipe": "rowwise"}, "precision.fp8_all_gather",
     "per-tensor (current) scaling only", "fp8_recipe=current"),
    ({**FP8_GPU, "precision.fp8_amax_history": 0}, "precision.fp8_amax_history", ">= 1", "1024"),
    ({**FP8_GPU, "precision.fp8_margin": -1}, "precision.fp8_margin", ">= 0", "use 0"),
    ({"precision.dtype": "bf16", "precision.fp8_emulate": True}, "precision.fp8_emulate",
     "only applies to FP8 but precision.dtype=bf16", "set precision.dtype=fp8"),
    ({"precision.dtype": "fp16", "precision.loss_scale_init": 0.0},
     "precision.loss_scale_init", "must be > 0", "65536"),
    ({"precision.dtype": "fp16", "precision.loss_scale_backoff": 1.0},
     "precision.loss_scale_backoff", "must lie in (0, 1)", "0.5"),
    ({"precision.dtype": "fp16", "precision.loss_scale_growth": 0.5},
     "precision.loss_scale_growth", "must be >= 1", "2.0"),
    ({"precision.dtype": "fp16", "precision.loss_scale_interval": 0},
     "precision.loss_scale_interval", "must be >= 1", "2000"),
    # Block scaling: where it runs, whole blocks, and the experts' grouped GEMMs.
    ({**EMULATED, "precision.fp8_recipe": "blockwise"}, "precision.fp8_recipe",
     "has no emulation, so fp8_emulate cannot run it on CPU", "fp8_recipe=mxfp8"),
    ({**FP8_GPU, "cluster.gpu_type": "l40s", "precision.fp8_recipe": "blockwise"},
     "precision.fp8_recipe", "128 x 128 block FP8 needs compute capability >= 9.0 (Hopper); "
     "l40s has 8.9", "fp8_recipe=current or rowwise"),
    ({**FP8_GPU, "precision.fp8_recipe": "mxfp8", "model.ffn_dim": 1008}, "model.ffn_dim",
     "FP8 matmuls (mxfp8 scaling) need multiples of 32; the width is 1008", "multiple of 32"),
    ({**FP8_GPU, "precision.fp8_recipe": "blockwise", "train.seq_len": 64,
      "train.micro_batch": 1}, "train.micro_batch", "(micro_batch x seq_len = 64) to be a "
     "multiple of 128", "a multiple of 128"),
    ({**FP8_GPU, "cluster.gpu_type": "b200", "precision.fp8_recipe": "mxfp8",
      "parallel.tp": 8}, "parallel.tp", "whose shards must be whole mxfp8 blocks of 32: the "
     "key/value width 128 / 8 is not", "a tp that leaves each shard a multiple of 32"),
    ({**EMULATED, **MOE, "precision.fp8_recipe": "rowwise"}, "precision.fp8_recipe",
     "routed experts run torchao's rowwise FP8 grouped GEMM, which quantizes with triton "
     "kernels", "fp8_recipe=mxfp8 (its grouped GEMM emulates)"),
    ({**FP8_GPU, **MOE, "cluster.gpu_type": "l40s", "precision.fp8_recipe": "rowwise"},
     "precision.fp8_recipe", "grouped GEMM, which needs compute capability >= 9.0; l40s "
     "has 8.9", "the experts stay in bf16"),
    ({**EMULATED, **MOE, "precision.fp8_recipe": "mxfp8", "model.moe_ffn_dim": 48},
     "model.moe_ffn_dim", "needs widths in whole blocks of 32; each rank's slice of an expert "
     "is 48 wide", "fp8_recipe=current"),
    ({**EMULATED, "precision.fp8_recipe": "mxfp8", "compile.enabled": True}, "compile.blocks",
     "no float8_e8m0fnu", "compile.backend=aot_eager"),
    ({**EMULATED, "precision.fp8_recipe": "mxfp8", "train.micro_batch": 1, "train.seq_len": 32,
      "parallel.cp": 2}, "train.micro_batch", "micro_batch x seq_len / cp 2 = 16",
     "a multiple of 32"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "field", "reason", "fix"), CASES)
def test_bad_precision_is_refused_with_a_fix(overrides, field, reason, fix):
    found = problems(configure(overrides))
    matching = [p for p in found if p.field == field and reason in p.reason]
    assert matching, f"no problem on {field} with {reason!r} in {[str(p) for p in found]}"
    assert fix in matching[0].fix


@pytest.mark.parametrize(
    "overrides",
    [
        FP8_GPU,
        {**FP8_GPU, "precision.fp8_backend": "te", "precision.fp8_recipe": "delayed"},
        {**FP8_GPU, "precision.fp8_backend": "te", "cluster.gpu_type": "b200",
         "precision.fp8_recipe": "mxfp8"},
        {**FP8_GPU, "cluster.gpu_type": "l40s", "precision.fp8_recipe": "rowwise"},
        {**FP8_GPU, "parallel.zero": 3, "precision.fp8_all_gather": True},
        {**FP8_CPU, "precision.fp8_emulate": True},
        {**EMULATED, **MOE, "precision.fp8_recipe": "mxfp8"},
        {**EMULATED, **MOE, "precision.fp8_recipe": "current"},
        {**FP8_GPU, **MOE, "cluster.gpu_type": "b200", "precision.fp8_recipe": "mxfp8"},
        {**FP8_GPU, **MOE, "precision.fp8_recipe": "blockwise", "train.seq_len": 256},
        {**FP8_GPU, "precision.fp8_backend": "te", "precision.fp8_recipe": "blockwise"},
        {**EMULATED, **MOE, "precision.fp8_recipe": "mxfp8", "parallel.tp": 2,
         "parallel.etp": 2, "parallel.ep": 2, "cluster.gpus_per_node": 4},
        {"precision.dtype": "fp16", "cluster.gpu_type": "v100_sxm_32gb"},
        {"precision.dtype": "fp16", "cluster.device": "cpu", "cluster.gpu_type": "cpu"},
        {**EMULATED, "precision.fp8_recipe": "mxfp8", "compile.enabled": True,
         "compile.backend": "aot_eager"},
        {**EMULATED, "precision.fp8_recipe": "mxfp8", "compile.enabled": True,
         "compile.blocks": False},
    ],
)  # fmt: skip
def test_runnable_precision_recipes_pass(overrides):
    validate(configure(overrides), for_launch=True)


@pytest.mark.skipif(backend_installed("te"), reason="Transformer Engine is installed here")
def test_a_local_run_with_transformer_engine_missing_says_what_to_install():
    cfg = configure({"precision.dtype": "fp8", "precision.fp8_backend": "te"})
    found = [p for p in problems(cfg) if p.field == "precision.fp8_backend"]
    assert [p.reason for p in found] == ["transformer_engine is not installed"]
    assert "transformer-engine[pytorch]" in found[0].fix
    assert "precision.fp8_backend=torchao" in found[0].fix


def test_a_slurm_run_leaves_the_backend_check_to_the_ranks():
    # The login node may lack the GPU stack the compute nodes have.
    cfg = configure({**FP8_GPU, "precision.fp8_backend": "te"})
    validate(cfg, for_launch=True)


def test_fp8_is_planned_against_the_fp8_peak_and_emulation_against_bf16():
    fp8 = configure(FP8_GPU)
    emulated = configure({**FP8_GPU, "precision.fp8_emulate": True})
    assert (peak_dtype(fp8.precision), peak_dtype(emulated.precision)) == ("fp8", "bf16")
    bf16 = make_plan(configure({"precision.dtype": "bf16"}))
    plan = make_plan(fp8)
    assert plan.peak_tflops == 2 * bf16.peak_tflops  # the H100 table: FP8 doubles BF16
    # The blocks' linear layers run at the FP8 rate, attention, the head and the element-wise
    # work as under BF16; the communication moves BF16 either way.
    assert bf16.step_cost.compute / 2 < plan.step_cost.compute < 0.9 * bf16.step_cost.compute
    assert plan.step_cost.dp_total == pytest.approx(bf16.step_cost.dp_total)
    assert plan.model_states_by_zero == bf16.model_states_by_zero


def test_the_plan_warns_when_fp8_leaves_the_experts_in_bf16():
    """torchao's per-tensor scaling has no grouped GEMM, and Transformer Engine's modules are
    swapped for the linear layers only: the routed experts stay bf16, which the plan says."""
    current = make_plan(configure({**FP8_GPU, **MOE})).warnings
    assert any(
        "the routed experts run in bf16 (torchao has no FP8 grouped GEMM" in w for w in current
    )
    te = configure({**FP8_GPU, **MOE, "precision.fp8_backend": "te"})
    assert any("Transformer Engine's linear layers only" in w for w in make_plan(te).warnings)
    mxfp8 = configure(
        {**FP8_GPU, **MOE, "cluster.gpu_type": "b200", "precision.fp8_recipe": "mxfp8"}
    )
    assert not any("routed experts" in w for w in make_plan(mxfp8).warnings)
