"""Recipe validation: every rule names the field, says why, and offers a fix."""

import pytest

from pretrain.core.problems import RecipeError
from pretrain.launcher.validate.layout import check_runnable
from pretrain.launcher.validate.recipe import validate
from tests.helpers import base, configure, problems


def test_base_recipe_is_valid():
    validate(base(), for_launch=True)


def test_error_line_names_field_value_reason_and_fix():
    error = RecipeError(problems(configure({"parallel.tp": 3})))
    assert (
        "parallel.tp=3: 32 attention heads are not divisible by 3; use 1, 2, 4 or 8"
        in str(error).splitlines()
    )


# (overrides, field, words of the reason, words of the fix)
CASES = [
    # layout and world size
    ({"parallel.tp": 3}, "parallel.tp", "32 attention heads are not divisible by 3",
     "use 1, 2, 4 or 8"),
    ({"parallel.tp": 8, "model.n_heads": 24, "model.n_kv_heads": 6, "model.dim": 480},
     "parallel.tp",
     "6 key/value heads are not divisible by 8, nor is tp a multiple of them",
     "use 1, 2, 3 or 6"),
    ({"parallel.tp": 16, "cluster.nodes": 2}, "parallel.tp", "larger than one node's 8 GPUs",
     "allow_tp_across_nodes=true"),
    ({"parallel.dp_shard": 4}, "parallel.dp_shard", "= 4 but the world size is 8",
     "parallel.dp_shard=8 or -1"),
    ({"parallel.dp_replicate": 3, "parallel.zero": 1}, "parallel.dp_shard",
     "world size 8 (1 node(s) x 8 GPU(s)) is not divisible by pp*dp_replicate*cp*tp",
     "divisors of 8: 1, 2, 4 or 8"),
    ({"parallel.tp": -1}, "parallel.tp", "must be >= 1", "use a value >= 1"),
    ({"parallel.pp": 0}, "parallel.pp", "must be >= 1", "use a value >= 1"),
    ({"parallel.dp_replicate": -1}, "parallel.dp_replicate", "must be >= 1", "use a value >= 1"),
    ({"parallel.dp_shard": 0}, "parallel.dp_shard", "-1 to fill the world", "use -1"),
    ({"parallel.dp_shard": -2}, "parallel.dp_shard", "-1 to fill the world", "use -1"),
    ({"model.dim": 500}, "model.dim", "not divisible by model.n_heads=32", "480 or 512"),
    ({"model.n_kv_heads": 5}, "model.n_kv_heads", "32 query heads cannot be grouped over 5",
     "1, 2, 4, 8, 16 or 32"),
    ({"parallel.pp": 3}, "parallel.pp", "8 layers are not divisible by pp*vpp = 3*1 = 3",
     "use pp in 1, 2, 4 or 8"),
    ({"parallel.pp": 8, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved_1f1b"},
     "parallel.pp", "8 layers are not divisible by pp*vpp = 8*2 = 16",
     "use pp in 2 or 4 or set vpp=1"),
    ({"train.global_batch": 60}, "train.global_batch", "micro_batch*dp = 2*8 = 16", "48 or 64"),
    ({"parallel.pp": 4, "train.global_batch": 4},
     "parallel.pp_microbatches", "1 micro-batch(es) (0 takes the gradient-accumulation count 1) "
     "cannot fill 4 pipeline stages", "raise train.global_batch to 16"),
    ({"parallel.pp": 2, "parallel.pp_microbatches": 1}, "parallel.pp_microbatches",
     "1 micro-batch(es) cannot fill 2 pipeline stages", "pp_microbatches >= 2"),
    ({"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved_1f1b",
      "parallel.pp_microbatches": 5},
     "parallel.pp_microbatches", "interleaving needs a multiple of pp=2", "use 4 or 6"),
    ({"parallel.pp_microbatches": -1}, "parallel.pp_microbatches", "must be >= 0", ">= 0"),
    ({"parallel.vpp": 2}, "parallel.vpp", "need pp > 1 and an interleaved schedule",
     "pp_schedule=interleaved_1f1b"),
    ({"parallel.pp": 2, "parallel.vpp": 2}, "parallel.vpp", "(pp=2, 1f1b)", "interleaved_1f1b"),
    ({"parallel.pp_schedule": "1F1B"}, "parallel.pp_schedule", "unknown value '1F1B'",
     "use gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev or 2bw"),
    ({"train.seq_len": 2048}, "train.seq_len", "longer than model.max_seq_len=1024",
     "train.seq_len <= 1024"),
    ({"parallel.tp": 4, "parallel.sp": True, "train.seq_len": 250}, "train.seq_len",
     "splits the sequence over tp=4", "use a multiple of 4, e.g. 248 or 252"),
    ({"parallel.sp": True}, "parallel.sp", "inside tensor parallelism", "sp=false"),
    ({"parallel.ep": 3}, "parallel.ep", "dp=8 is not divisible", "1, 2, 4 or 8"),
    ({"parallel.ep": 0}, "parallel.ep", "must be >= 1", ">= 1"),
    ({"parallel.zero": 4}, "parallel.zero", "not a ZeRO stage", "use 0 (DDP), 1, 2 or 3"),
    ({"parallel.dp_replicate": 2}, "parallel.dp_replicate", "hybrid sharding) need ZeRO >= 1",
     "parallel.zero to 1, 2 or 3"),
    # precision and hardware
    ({"precision.dtype": "bfloat16"}, "precision.dtype", "unknown value",
     "use fp32, bf16, fp16 or fp8"),
    ({"precision.dtype": "bf16", "cluster.gpu_type": "v100_sxm_32gb"}, "precision.dtype",
     "v100_sxm_32gb has no bf16 (compute capability 7.0 < 8.0)", "use fp32"),
    ({"cluster.gpu_type": "h100"}, "cluster.gpu_type", "unknown value 'h100'", "h100_sxm"),
    ({"hardware.peak_tflops": -1.0}, "hardware.peak_tflops", "must be >= 0", ">= 0"),
    ({"cluster.gpu_memory_gib": -1.0}, "cluster.gpu_memory_gib", "must be >= 0", ">= 0"),
    # cluster and SLURM
    ({"cluster.backend": "k8s"}, "cluster.backend", "unknown value 'k8s'", "use local or slurm"),
    ({"cluster.device": "tpu"}, "cluster.device", "unknown value 'tpu'", "use cuda or cpu"),
    ({"cluster.nodes": 0}, "cluster.nodes", "must be >= 1", ">= 1"),
    ({"cluster.gpus_per_node": 0}, "cluster.gpus_per_node", "must be >= 1", ">= 1"),
    ({"cluster.backend": "slurm", "cluster.time": "1 hour"}, "cluster.time",
     "not a time limit sbatch accepts", "[D-]HH:MM:SS"),
    ({"cluster.backend": "slurm", "cluster.time": "2h"}, "cluster.time", "sbatch", "HH:MM:SS"),
    ({"cluster.backend": "slurm", "cluster.time": "01:00:00:00"}, "cluster.time", "sbatch",
     "HH:MM:SS"),
    ({"cluster.backend": "slurm", "cluster.partition": "gpu;reboot"}, "cluster.partition",
     "only letters, digits", "partition name"),
    ({"cluster.backend": "slurm", "cluster.account": "my account"}, "cluster.account",
     "only letters, digits", "account name"),
    ({"cluster.backend": "slurm", "cluster.qos": "$(id)"}, "cluster.qos", "only letters, digits",
     "qos"),
    ({"name": "my run!"}, "name", "only letters, digits, '_', '.' and '-'", "use my_run"),
    ({"action": "train"}, "action", "unknown value 'train'", "dryrun or calibrate"),
    # optimizer and schedule
    ({"optim.lr": -1.0}, "optim.lr", "must be >= 0", ">= 0"),
    ({"optim.min_lr": -1.0}, "optim.min_lr", "must be >= 0", ">= 0"),
    ({"optim.min_lr": 1.0}, "optim.min_lr", "above the peak optim.lr=0.0003", "min_lr <= 0.0003"),
    ({"optim.weight_decay": -0.1}, "optim.weight_decay", "must be >= 0", ">= 0"),
    ({"optim.grad_clip": -1.0}, "optim.grad_clip", "must be >= 0", ">= 0"),
    ({"optim.betas": [0.9, 1.0]}, "optim.betas", "two values in [0, 1)", "[0.9, 0.95]"),
    ({"optim.betas": [0.9]}, "optim.betas", "two values in [0, 1)", "[0.9, 0.95]"),
    ({"optim.betas": [-0.1, 0.95]}, "optim.betas", "two values in [0, 1)", "[0.9, 0.95]"),
    ({"optim.name": "adam"}, "optim.name", "unknown value 'adam'", "use adamw, lion, sgd or muon"),
    ({"optim.lr_scaling": "cubic"}, "optim.lr_scaling", "unknown value",
     "use none, linear or sqrt"),
    ({"optim.lr_scaling": "sqrt"}, "optim.base_batch", "lr_scaling=sqrt scales relative",
     "that global batch (e.g. 64)"),
    ({"schedule.name": "step"}, "schedule.name", "unknown value",
     "cosine, linear, constant or wsd"),
    ({"schedule.warmup_steps": 101}, "schedule.warmup_steps", "longer than train.steps=100",
     "use at most 100"),
    ({"schedule.warmup_steps": -1}, "schedule.warmup_steps", "must be >= 0", ">= 0"),
    ({"schedule.decay_steps": -1}, "schedule.decay_steps", "must be >= 0", ">= 0"),
    ({"schedule.warmup_steps": 30, "schedule.decay_steps": 80}, "schedule.decay_steps",
     "warmup_steps + decay_steps = 110 > train.steps=100", "use at most 70"),
    ({"recompute.policy": "partial"}, "recompute.policy", "unknown value",
     "none, full or selective"),
    ({"recompute.every": 0}, "recompute.every", "must be >= 1", ">= 1"),
    # batch, logging, output, data
    ({"train.steps": 0}, "train.steps", "must be >= 1", ">= 1"),
    ({"train.seq_len": 0}, "train.seq_len", "must be >= 1", ">= 1"),
    ({"train.micro_batch": 0}, "train.micro_batch", "must be >= 1", ">= 1"),
    ({"train.global_batch": 0}, "train.global_batch", "must be >= 1", ">= 1"),
    ({"logging.log_every": 0}, "logging.log_every", "must be >= 1", ">= 1"),
    ({"logging.system_every_s": -1.0}, "logging.system_every_s", "must be >= 0", ">= 0"),
    ({"logging.wandb": "on"}, "logging.wandb", "unknown value",
     "auto, online, offline or disabled"),
    ({"plan.format": "yaml"}, "plan.format", "unknown value 'yaml'", "use table or json"),
    ({"data.format": "csv"}, "data.format", "unknown value 'csv'", "megatron or prepared"),
    ({"data.max_bytes": -1}, "data.max_bytes", "must be >= 0", ">= 0"),
    # model
    ({"model.name": "gpt2"}, "model.name", "unknown value 'gpt2'", "use llama"),
    ({"model.vocab_size": 0}, "model.vocab_size", "must be >= 1", ">= 1"),
    ({"model.dim": 0}, "model.dim", "must be >= 1", ">= 1"),
    ({"model.n_layers": 0}, "model.n_layers", "must be >= 1", ">= 1"),
    ({"model.n_heads": 0}, "model.n_heads", "must be >= 1", ">= 1"),
    ({"model.n_kv_heads": -1}, "model.n_kv_heads", "must be >= 0", ">= 0"),
    ({"model.ffn_dim": 0}, "model.ffn_dim", "must be >= 1", ">= 1"),
    ({"model.max_seq_len": 0}, "model.max_seq_len", "must be >= 1", ">= 1"),
    ({"model.rope_theta": 0.0}, "model.rope_theta", "must be > 0", "positive"),
    ({"model.norm_eps": 0.0}, "model.norm_eps", "must be > 0", "positive"),
    ({"model.init_std": -0.02}, "model.init_std", "must be > 0", "positive"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "field", "reason", "fix"), CASES)
def test_each_rule_reports_field_reason_and_fix(overrides, field, reason, fix):
    found = problems(configure(overrides))
    matching = [p for p in found if p.field == field and reason in p.reason]
    assert matching, f"no problem on {field} with {reason!r} in {[str(p) for p in found]}"
    assert fix in matching[0].fix
    assert str(matching[0]).startswith(f"{field}=")


def test_several_bad_fields_are_all_reported_in_one_error():
    cfg = configure({"parallel.tp": 3, "precision.dtype": "fp4", "optim.lr": -1.0, "name": "a b"})
    fields = {p.field for p in problems(cfg)}
    assert {"parallel.tp", "precision.dtype", "optim.lr", "name"} <= fields


def test_a_degree_that_cannot_tile_the_world_is_one_problem_not_a_cascade():
    # A bad world size leaves dp unknown; the batch rule must not report a second problem.
    found = problems(configure({"parallel.dp_shard": 3}))
    assert [p.field for p in found] == ["parallel.dp_shard"]


@pytest.mark.parametrize(
    "time", ["30", "30:00", "01:00:00", "2-00", "2-12:30", "1-00:00:00", "100:00:00", "UNLIMITED"]
)
def test_every_time_format_sbatch_accepts_passes(time):
    validate(configure({"cluster.backend": "slurm", "cluster.time": time, "cluster.qos": "high"}))


def test_valid_hybrid_sharding_interleaved_pipeline_and_tp_layout_passes():
    cfg = configure(
        {
            "cluster.nodes": 4,
            "parallel.tp": 4,
            "parallel.sp": True,
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.dp_replicate": 2,
            "parallel.zero": 3,
            "parallel.ep": 2,
            "train.global_batch": 64,
        }
    )
    validate(cfg)


def test_a_layout_the_trainer_cannot_run_fails_only_for_launch():
    cfg = configure(
        {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble",
         "recompute.policy": "selective", "train.global_batch": 64}
    )  # fmt: skip
    validate(cfg, for_launch=False)
    runnable = [p for p in check_runnable(cfg) if p.field == "recompute.policy"]
    assert len(runnable) == 1
    assert "hands each kept tensor to one backward only" in runnable[0].reason
    assert "recompute.policy" in [p.field for p in problems(cfg, for_launch=True)]


def test_plain_data_parallel_layout_is_runnable():
    assert check_runnable(configure({"parallel.zero": 3})) == []


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("degree", ["parallel.tp", "parallel.pp"])
def test_ddp_and_zero1_over_tensor_or_pipeline_parallel_replicas_are_runnable(
    degree: str, zero: int
) -> None:
    """ZeRO-0's reduction (ZeRO-1's too) runs on FSDP2's replicate where DDP cannot go, and
    ZeRO-1's sharded optimizer takes DTensors (parallel/data_parallel.py,
    parallel/zero/sharded_optimizer.py)."""
    assert check_runnable(configure({degree: 2, "parallel.zero": zero})) == []


def test_pipelined_mixture_of_experts_with_expert_parallelism_is_runnable():
    cfg = configure(
        {
            "model.moe_experts": 4,
            "model.moe_top_k": 2,
            "parallel.pp": 2,
            "parallel.ep": 2,
            "parallel.zero": 2,
        }
    )
    validate(cfg)
    assert check_runnable(cfg) == []


def test_divisors_come_from_factors_and_long_lists_are_cut() -> None:
    """Never n steps: a prime near 10**9 or 10**30 is factored at once, and a message lists
    at most MAX_LISTED of them."""
    from pretrain.core.problems import MAX_LISTED, divisors, or_list

    for n in range(1, 2000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(999_999_937) == [1, 999_999_937]
    assert len(divisors(10**30)) == 31 * 31
    listed = or_list(divisors(720_720))
    assert listed.startswith("1, 2, 3, 4,") and listed.endswith("or 720720")
    assert len(listed.split(", ")) <= MAX_LISTED + 1
