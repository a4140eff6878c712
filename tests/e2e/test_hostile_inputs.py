"""Hostile and careless input, table-driven: every case must exit with code 2, print no
traceback, name the field (or file) at fault, and write nothing anywhere.

The CLI runs in this process (a subprocess costs half a second each). Cases refused before
Hydra composes run the whole command (`main`); cases refused by the validator or the run
dir run everything after composition (`execute`) on the tiny recipe composed once with
their overrides applied, since each Hydra composition costs about a second here; a few of
them, and a few of the others as real `pretrain` processes, run the whole way too.
Data-source and tokenizer values are checked by the data rules and have their own tests.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pretrain.core.run.rundir import LOCK_FILE
from pretrain.core.schema import to_recipe
from pretrain.launcher import cli as pretrain_cli
from tests.helpers import pretrain, pretrain_in_process, tree

pytestmark = pytest.mark.e2e

SECRET = "planted-secret-8f2a1c"
"""The value of PRETRAIN_TEST_TOKEN in every case's environment."""


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    """Arguments after `pretrain`; {root} is the sandbox."""
    field: str
    """Must appear in stderr: the field, key or file at fault ({root} allowed)."""
    composed: bool = False
    """Refused after composition: run `execute` on the composed recipe (see the module doc)."""


def bomb() -> str:
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcde", "bcdef", strict=True):
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(rows) + "\n"


HEADER = "defaults:\n  - recipe_schema\n  - _self_\n"
RECIPE_FILES: dict[str, bytes] = {
    "bomb": bomb().encode(),
    "deep": ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(),
    "latin1": (HEADER + "name: caf\xe9\n").encode("latin-1"),
    "binary": bytes(range(256)) * 4,
    "syntax": (HEADER + "train: {steps: 5\n").encode(),
    "toplist": b"- model\n- parallel\n",
    "huge": (HEADER + "# " + "x" * (2 << 20) + "\n").encode(),
    "callbacks": (
        HEADER + "hydra:\n  callbacks:\n    x:\n      _target_: builtins.open\n"
        "      file: /tmp/owned\n      mode: w\n"
    ).encode(),
    "launcher": (
        HEADER.replace("  - _self_", "  - override hydra/launcher: basic\n  - _self_")
    ).encode(),
    "unknownkey": (HEADER + "model:\n  hiddne: 3\n").encode(),
    "wrongtype": (HEADER + "train:\n  steps: many\n").encode(),
    "badoption": HEADER.replace("  - _self_", "  - model: tyni\n  - _self_").encode(),
}
"""Hostile recipe files, each alone in recipes/<name>/<name>.yaml."""

CALLBACK = "callbacks:\n  x:\n    _target_: builtins.open\n    file: {root}/owned\n    mode: w\n"
RECIPE_TREES: dict[str, dict[str, str]] = {
    # A group file whose header moves it into Hydra's settings: a callback that opens (and
    # truncates) any file would run at composition.
    "pkg_hydra": {"model/evil.yaml": "# @package hydra\n" + CALLBACK},
    "pkg_global_hydra": {"model/evil.yaml": "# @package _global_.hydra\n" + CALLBACK},
    "pkg_hydra_callbacks": {
        "model/evil.yaml": "# @package hydra.callbacks\n" + CALLBACK.split("\n", 1)[1]
    },
    # Hydra reads every leading `# @key value` line, not only the first.
    "pkg_second_header_line": {"model/evil.yaml": "# @foo bar\n# @package hydra\n" + CALLBACK},
    "pkg_primary_hydra": {"main.yaml": "# @package hydra\n" + CALLBACK},
    "pkg_unknown_section": {"model/evil.yaml": "# @package nowhere\nsteps: 3\n"},
    "defaults_at_hydra": {
        "main.yaml": "defaults:\n  - tiny\n  - grp@hydra: evil\n  - _self_\n",
        "grp/evil.yaml": CALLBACK,
    },
    "defaults_string_at_hydra": {
        "main.yaml": "defaults:\n  - tiny\n  - grp/evil@hydra\n  - _self_\n",
        "grp/evil.yaml": CALLBACK,
    },
    "clean": {},
}
"""Hostile recipe trees, each in recipes/<name>/ with main.yaml (the tiny recipe, unless
the tree has its own) as the recipe composed."""


def recipe(name: str, field: str = "") -> Case:
    args = ("--config-dir", f"{{root}}/recipes/{name}", "--config-name", name)
    return Case(f"recipe_{name}", args, field or f"{{root}}/recipes/{name}/{name}.yaml")


def cli(case_id: str, *args: str, field: str = "") -> Case:
    return Case(case_id, args, field or args[-1].lstrip("+~").split("=")[0])


def rule(case_id: str, *args: str, field: str = "") -> Case:
    """A case the validator or the run-dir checks refuse, after composition."""
    return Case(case_id, args, field or args[-1].lstrip("+~").split("=")[0], composed=True)


def tree_case(name: str, field: str, *args: str) -> Case:
    dirs = ("--config-dir", f"{{root}}/trees/{name}", "--config-name", "main")
    return Case(f"tree_{name}", (*dirs, *args, "action=plan"), field)


CASES = [
    # Hydra's settings reached through a file's package header or a defaults entry
    tree_case("pkg_hydra", "hydra.callbacks.x._target_", "model=evil"),
    tree_case("pkg_global_hydra", "hydra.callbacks.x._target_", "model=evil"),
    tree_case("pkg_hydra_callbacks", "hydra.callbacks.x._target_", "model=evil"),
    tree_case("pkg_second_header_line", "hydra.callbacks.x._target_", "model=evil"),
    tree_case("pkg_primary_hydra", "hydra.callbacks.x._target_"),
    tree_case("pkg_unknown_section", "nowhere.steps", "model=evil"),
    tree_case("defaults_at_hydra", "defaults: grp@hydra"),
    tree_case("defaults_string_at_hydra", "defaults: grp/evil@hydra"),
    # a recipe named by a path out of the search path skips every file check
    cli(
        "config_name_dotdot",
        *("--config-dir", "{root}/trees/clean", "--config-name", "../../outside"),
        field="--config-name=../../outside",
    ),
    cli("config_name_absolute", "--config-name", "{root}/outside", field="--config-name="),
    cli("config_name_home", "--config-name", "~/outside", field="--config-name="),
    # Hydra-level: keys, types, groups, recipes, syntax
    cli("unknown_key", "model.hidden=3"),
    cli("typo_did_you_mean", "parallel.tpp=2", field="did you mean parallel.tp"),
    cli("plus_unknown_key", "+parallel.tpp=2"),
    cli("plus_unknown_top_level", "+foo=1"),
    cli("plus_existing_key", "+parallel.tp=2", field="+parallel.tp"),
    cli("int_not_a_number", "train.steps=many"),
    cli("float_not_a_number", "optim.lr=fast"),
    cli("bool_not_a_bool", "logging.all_ranks=maybe"),
    cli("float_for_an_int", "train.steps=1e12"),
    cli("list_for_an_int", "model.dim=[1,2]"),
    cli("scalar_for_a_mapping", "cluster.env=5"),
    cli("bad_list_element", "optim.betas=[0.9,x]"),
    cli("unparsable_override", "model.dim=[1,"),
    cli("unknown_group_option", "precision=bf61"),
    cli("unknown_model", "model=huge"),
    cli("mapping_for_a_group", "parallel={tp:2}"),
    cli("unknown_recipe", "--config-name", "tyni", field="--config-name=tyni"),
    cli("sweep_without_multirun", "seed=1,2"),
    cli("group_at_package", "model@x=tiny", field="model@x"),
    cli("deep_list_argument", "model.dim=" + "[" * 5000 + "]" * 5000, field="model.dim"),
    cli("overlong_argument", "name=" + "x" * 20000, field="name"),
    cli("not_utf8_argument", "name=caf\udce9", field="name"),
    # Hydra's own settings, which run code or write files
    cli("hydra_callbacks", "+hydra.callbacks.x._target_=builtins.open", field="hydra.callbacks"),
    cli("hydra_launcher", "hydra/launcher=basic", field="hydra/launcher"),
    cli("hydra_run_dir", "hydra.run.dir={root}/elsewhere", field="hydra.run.dir"),
    cli("hydra_searchpath", "hydra.searchpath=[pkg://os]", field="hydra.searchpath"),
    cli("hydra_job_logging", "hydra/job_logging=default", field="hydra/job_logging"),
    # recipe files read defensively
    recipe("bomb"),
    recipe("deep"),
    recipe("latin1"),
    recipe("binary"),
    recipe("syntax"),
    recipe("toplist"),
    recipe("huge"),
    recipe("callbacks", "hydra.callbacks.x._target_"),
    recipe("launcher", "defaults: override hydra/launcher"),
    recipe("unknownkey", "model.hiddne"),
    recipe("wrongtype", "train.steps=many"),
    recipe("badoption", "defaults: model=tyni"),
    cli(
        "config_dir_package", "--config-dir", "pkg://os", "--config-name", "x", field="--config-dir"
    ),
    cli(
        "config_dir_missing",
        "--config-dir",
        "{root}/nowhere",
        "--config-name",
        "x",
        field="--config-dir",
    ),
    # cluster.env: secrets, the job script's own variables, torchrun's
    rule("env_wandb_api_key", "+cluster.env.WANDB_API_KEY=abcdef0123456789"),
    rule("env_hf_token", "+cluster.env.HF_TOKEN=hf_abcdef0123456789"),
    rule("env_service_key", "+cluster.env.MY_SERVICE_KEY=abc"),
    rule("env_password", "+cluster.env.DB_PASSWORD=hunter2"),
    rule("env_aws_secret", "+cluster.env.AWS_SECRET_ACCESS_KEY=abc"),
    rule("env_path", "+cluster.env.PATH=/evil"),
    rule("env_ld_preload", "+cluster.env.LD_PRELOAD=/evil.so"),
    rule("env_ld_library_path", "+cluster.env.LD_LIBRARY_PATH=/evil"),
    rule("env_bash_env", "+cluster.env.BASH_ENV=/evil.sh"),
    rule("env_env", "+cluster.env.ENV=/evil.sh"),
    rule("env_pythonpath", "+cluster.env.PYTHONPATH=/evil"),
    rule("env_pythonstartup", "+cluster.env.PYTHONSTARTUP=/evil.py"),
    cli("env_bad_name", "+cluster.env.1BAD=x", field="cluster.env.1BAD"),
    rule("env_omp_zero", "+cluster.env.OMP_NUM_THREADS=0"),
    rule("env_torchrun_rank", "+cluster.env.RANK=3"),
    rule("secret_via_oc_env", "+cluster.env.MY_VAR=${oc.env:PRETRAIN_TEST_TOKEN}"),
    rule("secret_in_another_field", "logging.wandb_project=${oc.env:PRETRAIN_TEST_TOKEN}"),
    # run.dir
    rule("run_dir_root", "run.dir=/", field="run.dir=/"),
    rule("run_dir_home", "run.dir='~'", field="run.dir="),
    rule("run_dir_cwd", "run.dir=.", field="run.dir="),
    rule("run_dir_a_file", "run.dir={root}/notes.txt", field="run.dir="),
    rule("run_dir_foreign_folder", "run.dir={root}/photos", field="run.dir="),
    rule("run_dir_under_a_file", "run.dir={root}/notes.txt/run", field="run.dir="),
    rule("run_dir_read_only", "run.dir={root}/ro/run", field="run.dir="),
    rule("run_dir_long_name", "run.dir={root}/" + "n" * 300, field="run.dir="),
    rule("run_dir_long_path", "run.dir={root}" + "/p" * 2100, field="run.dir="),
    rule("run_dir_in_use", "run.dir={root}/busy", field="run.dir"),
    rule("run_dir_of_another_recipe", "run.dir={root}/oldrun", field="seed"),
    rule("local_run_on_several_nodes", "cluster.nodes=2", field="cluster.nodes=2"),
    rule(
        "run_dir_newline_on_slurm",
        "cluster=slurm",
        "action=script",
        "run.dir='{root}/a\nb'",
        field="run.dir=",
    ),
    # values the ranks would die on
    rule("seed_negative", "seed=-1"),
    rule("seed_too_large", "seed=4294967296"),
    rule("lr_infinite", "optim.lr=inf"),
    rule("lr_nan", "optim.lr=nan"),
    rule("norm_eps_nan", "model.norm_eps=nan"),
    rule("peak_tflops_infinite", "hardware.peak_tflops=inf"),
    rule("timeout_nan", "faults.collective_timeout_s=nan"),
    rule("port_negative", "cluster.master_port=-1"),
    rule("port_too_large", "cluster.master_port=70000"),
    rule("cpus_per_task_zero", "cluster.cpus_per_task=0"),
    rule("signal_seconds_negative", "cluster.signal_seconds=-5"),
    rule("omp_threads_zero", "cluster.omp_num_threads=0"),
    rule("steps_absurd", "train.steps=1000000000000"),
    rule("global_batch_absurd", "train.global_batch=100000000000000000000000"),
    rule("micro_batch_above_global", "train.micro_batch=32", field="train.micro_batch=32"),
    rule("cuda_without_cuda", "cluster.device=cuda", field="cluster.device"),
    rule("gpus_per_node_zero", "cluster.gpus_per_node=0"),
    rule("unknown_action", "action=fly"),
    rule("name_with_spaces", "name='a b'", field="name="),
    rule("warmup_negative", "schedule.warmup_steps=-1"),
    rule("betas_one_value", "optim.betas=[0.9]"),
    rule("tp_not_dividing_heads", "parallel.tp=3"),
    rule("slurm_time", "cluster=slurm", "action=script", "cluster.time=forever"),
    rule(
        "slurm_partition",
        "cluster=slurm",
        "action=script",
        "cluster.partition='a;b'",
        field="cluster.partition",
    ),
    # accepted, then failing on the ranks, though the recipe alone says so
    rule("hub_source_without_name", "data.source=hf:", field="data.source=hf:"),
    rule("hub_source_blank_name", "data.source='hf: :x'", field="data.source"),
    rule("vocab_below_byte_bpe", "model.vocab_size=10", field="model.vocab_size=10"),
    # Hydra's own words, said as ours
    cli("plus_twice", "+cluster.env.X=1", "+cluster.env.X=2", field="+cluster.env.X"),
    cli("delete_missing", "~cluster.env.NOPE", field="~cluster.env.NOPE"),
    cli("empty_argument", "", field="argument="),
    cli("key_only_equals", "=x", field="no key before"),
    cli("homoglyph_in_key", "tr\u0430in.steps=3", field="did you mean train.steps"),
    # numbers no message or search may enumerate up to, and sweeps too large to start
    rule("heads_huge_prime", "model.n_heads=999999937", field="999999937"),
    cli("sweep_too_large", "-m", "seed=range(0,100000)", "action=plan", field="100,000 points"),
    cli("sweep_needs_yes", "-m", "seed=range(0,65)", "action=plan", field="--yes"),
    cli(
        "sweep_product_too_large",
        *("-m", "seed=range(0,1000)", "train.steps=range(1,12)", "action=plan"),
        field="11,000 points",
    ),
    cli(
        "optuna_trials_too_many",
        *("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=100000"),
        *("optim.lr=interval(1e-4,1e-2)", "action=plan"),
        field="hydra.sweeper.n_trials",
    ),
    # directives the job script owns, given in cluster.sbatch_extra (or abbreviated)
    *(
        rule(
            f"sbatch_extra_{name}",
            "cluster=slurm",
            "action=script",
            f"cluster.sbatch_extra=['{directive}']",
            field=owner,
        )
        for name, directive, owner in [
            ("ntasks", "--ntasks=3", "cluster.sbatch_extra[0]"),
            ("nodes", "--nodes=4", "cluster.nodes"),
            ("array", "--array=0-9", "-m"),
            ("chdir", "--chdir=/", "--chdir"),
            ("export", "--export=NONE", "cluster.env"),
            ("signal", "--signal=B:USR1@5", "cluster.signal_seconds"),
            ("no_requeue", "--no-requeue", "--no-requeue"),
            ("output", "--output=/tmp/x", "run.dir"),
            ("abbreviated_output", "--out=/tmp/x", "--output"),
            ("abbreviated_chdir", "--chd=/", "--chdir"),
        ]
    ),
    # Further cases, written from each class of issue 28 rather than from its examples.
    # Security: Hydra's settings through the sweeper allowance, a program with arguments
    cli(
        "optuna_storage_writes_a_file",
        *("-m", "hydra/sweeper=optuna", "hydra.sweeper.storage=sqlite:///{root}/owned.db"),
        *("optim.lr=interval(1e-4,1e-2)", "action=plan"),
        field="hydra.sweeper.storage",
    ),
    cli(
        "optuna_sweeper_target",
        *("-m", "hydra/sweeper=optuna", "hydra.sweeper._target_=builtins.exec"),
        *("optim.lr=interval(1e-4,1e-2)", "action=plan"),
        field="hydra.sweeper._target_",
    ),
    cli("hydra_output_subdir", "hydra.output_subdir={root}/x", field="hydra.output_subdir"),
    cli("hydra_job_chdir", "hydra.job.chdir=true", field="hydra.job.chdir"),
    rule(
        "python_with_arguments",
        "cluster=slurm",
        "action=script",
        "cluster.python='/bin/sh -c id'",
        field="cluster.python=",
    ),
    # Unbounded arithmetic: counts a rule, a message or the planner would walk
    rule("pp_huge_prime", "parallel.pp=999999937"),
    rule("dp_shard_huge_prime", "parallel.dp_shard=1000000007"),
    rule("global_batch_prime", "train.global_batch=16777213"),
    rule("ep_over_prime_experts", "model.moe_experts=16381", "parallel.ep=2", field="parallel.ep"),
    rule("max_restarts_absurd", "cluster.max_restarts=1000000000"),
    rule("omp_threads_absurd", "cluster.omp_num_threads=1000000000"),
    rule("loss_chunks_absurd", "train.loss_chunks=1000000000"),
    rule("eval_batches_absurd", "eval.batches=1000000000"),
    rule(
        "world_absurd",
        "cluster.nodes=65536",
        "cluster.gpus_per_node=1024",
        field="67,108,864 ranks",
    ),
    # Files read without checking what they are or what they hold
    rule("data_folder_of_a_fifo", "data.source={root}/data_fifo", field="holds no data files"),
    rule(
        "prepared_manifest_shards_a_mapping",
        "data.source={root}/prepared_bad",
        field="its manifest cannot be used: no list of shards",
    ),
    rule(
        "prepared_manifest_a_list",
        "data.source={root}/prepared_list",
        field="its manifest cannot be used: holds a list",
    ),
    rule("hf_config_a_fifo", "init.from_hf={root}/hf_fifo", field="init.from_hf="),
    rule(
        "hf_config_a_list",
        "init.from_hf={root}/hf_list",
        field="{root}/hf_list/config.json: holds a list",
    ),
    rule(
        "tokenizer_json_a_list",
        "data.tokenizer={root}/tok_dir",
        field="tokenizer.json: holds a list",
    ),
    rule("tokenizer_json_a_fifo", "data.tokenizer={root}/fifo", field="data.tokenizer="),
    rule(
        "megatron_index_a_fifo",
        "data.source={root}/mega/c",
        "data.format=megatron",
        "data.tokenizer=none",
        "data.vocab_size=4096",
        field="no PREFIX.bin and PREFIX.idx",
    ),
    rule(
        "sbatch_template_a_fifo",
        "cluster=slurm",
        "action=script",
        "cluster.sbatch_template={root}/fifo",
        field="not a regular file",
    ),
    cli("status_of_a_fifo", "status", "{root}/fifo", field="{root}/fifo"),
    # Job settings that contradict each other, SLURM's limits or the run's disk
    rule(
        "stop_signal_after_the_time_limit",
        "cluster=slurm",
        "action=script",
        "cluster.time=00:30:00",
        "cluster.signal_seconds=3600",
        field="for ever",
    ),
    rule(
        "stop_signal_shorter_than_the_save",
        "cluster=slurm",
        "action=script",
        *("model.dim=8192", "model.n_layers=80", "model.n_heads=64", "model.ffn_dim=28672"),
        "cluster.signal_seconds=31",
        field="killed mid-save",
    ),
    rule("partition_on_a_local_run", "cluster.partition=gpu"),
    rule("account_on_a_local_run", "cluster.account=proj"),
    rule("qos_on_a_local_run", "cluster.qos=high"),
    cli(
        "cpu_partition_with_a_semicolon",
        "cluster=slurm",
        "action=script",
        "cluster.cpu_partition=a;b",
        field="cluster.cpu_partition",
    ),
    rule(
        "disk_cannot_hold_the_checkpoints",
        "checkpoint.every=1",
        "train.steps=1000000",
        "checkpoint.keep=1000000",
        field="checkpoint.keep",
    ),
    rule("gpus_per_node_absurd", "cluster=slurm", "action=script", "cluster.gpus_per_node=4096"),
    # Accepted, then failing on the ranks, though the recipe alone says so
    rule("val_fraction_all", "data.val_fraction=1.0"),
    rule("max_tokens_below_one_sequence", "data.max_tokens=1"),
    rule(
        "source_max_tokens_below_one_sequence",
        "data.sources=[{source:stdlib,max_tokens:5}]",
        field="data.sources[0].max_tokens",
    ),
    rule(
        "seq_len_over_max_seq_len",
        "train.seq_len=4096",
        "model.max_seq_len=2048",
        field="train.seq_len",
    ),
    rule("experts_absurd", "model.moe_experts=1000000007"),
    rule("vocab_absurd", "model.vocab_size=100000000000"),
    rule("eval_every_negative", "eval.every=-1"),
    # Unclear: each refusal names what is wrong, and a fix that is itself accepted
    cli("precision_in_capitals", "precision=BF16", field="bf16"),
    rule("action_in_capitals", "action=PLAN", field="action=PLAN"),
    cli("steps_not_a_number", "train.steps=1_0x0"),
    rule("tp_zero", "parallel.tp=0"),
    rule(
        "more_stages_than_layers",
        "parallel.pp=8",
        "cluster.gpus_per_node=8",
        field="at most 4 stages",
    ),
    rule(
        "pp_layers_with_empty_stages",
        "parallel.pp=8",
        "cluster.gpus_per_node=8",
        "parallel.pp_layers=[1,1,1,1,0,0,0,0]",
        field="use pp*vpp <= 4",
    ),
    # the same refusals through the whole command
    cli("run_dir_in_use_through_main", "run.dir={root}/busy", field="run.dir"),
    cli("env_path_through_main", "+cluster.env.PATH=/evil", field="cluster.env.PATH"),
    # several problems, each still reported (train.steps does not hide the batch rule)
    rule(
        "dependent_checks_still_run",
        "train.steps=0",
        "train.global_batch=15",
        field="train.global_batch=15",
    ),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sandbox: a working dir, a home, a file, a foreign folder, a run dir in use, one of
    another recipe, a read-only folder and the hostile recipe files."""
    root = tmp_path_factory.mktemp("hostile")
    for name in ("work", "home", "photos", "busy", "oldrun", "ro"):
        (root / name).mkdir()
    (root / "oldrun" / "config.yaml").write_text("name: tiny\nseed: 1\n")
    (root / "notes.txt").write_text("not a run dir\n")
    (root / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    (root / "busy" / "config.yaml").write_text("name: tiny\n")
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": "now",
        "token": "someone-else",
        "slurm_job_id": "",
        "pid_start": 0,
    }
    (root / "busy" / LOCK_FILE).write_text(json.dumps(holder))
    for name, content in RECIPE_FILES.items():
        (root / "recipes" / name).mkdir(parents=True)
        (root / "recipes" / name / f"{name}.yaml").write_bytes(content)
    for name, files in RECIPE_TREES.items():
        files = {"main.yaml": "defaults:\n  - tiny\n  - _self_\n", **files}
        for relative, text in files.items():
            (root / "trees" / name / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / "trees" / name / relative).write_text(text.replace("{root}", str(root)))
    # Files that are not what they should be, for the further cases.
    for name in ("data_fifo", "prepared_bad", "prepared_list", "hf_fifo", "hf_list", "tok_dir",
                 "mega"):  # fmt: skip
        (root / name).mkdir()
    os.mkfifo(root / "fifo")
    os.mkfifo(root / "data_fifo" / "a.jsonl")
    (root / "prepared_bad" / "manifest.json").write_text('{"shards": {"a": 1}, "tokens": 3}')
    (root / "prepared_list" / "manifest.json").write_text("[1, 2, 3]")
    os.mkfifo(root / "hf_fifo" / "config.json")
    (root / "hf_list" / "config.json").write_text("[1]")
    (root / "tok_dir" / "tokenizer.json").write_text("[1]")
    (root / "mega" / "c.bin").write_bytes(bytes(64))
    os.mkfifo(root / "mega" / "c.idx")
    # An alias bomb outside every search path: reached only by a path as the recipe name.
    (root / "outside.yaml").write_bytes(RECIPE_FILES["bomb"])
    mounted = (
        os.geteuid() == 0
        and not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root / "ro")],
            capture_output=True,
        ).returncode
    )
    if not mounted:
        (root / "ro").chmod(0o555)
    yield root
    if mounted:
        subprocess.run(["umount", str(root / "ro")], check=True)


@pytest.fixture(autouse=True)
def environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted secret and a home of our own; launching or submitting would be a failure."""
    monkeypatch.setenv("PRETRAIN_TEST_TOKEN", SECRET)
    monkeypatch.setenv("HOME", str(root / "home"))

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a hostile case reached the launch")

    monkeypatch.setattr("pretrain.launcher.job.backends.run_local", launched)
    monkeypatch.setattr("pretrain.launcher.job.backends.submit_slurm", launched)


def skip_if_not_applicable(case: Case) -> None:
    if case.id == "cuda_without_cuda" and Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("this machine has CUDA")
    # Root writes anywhere but to a read-only file system, which the fixture mounts.
    root_without_mount = (
        case.id == "run_dir_read_only"
        and os.geteuid() == 0
        and not (os.path.ismount(Path(case.args[0].split("=", 1)[1]).parent))
    )
    if root_without_mount:
        pytest.skip("no read-only file system could be mounted")


_COMPOSED: dict[tuple[str, ...], Any] = {}


def _composed(groups: tuple[str, ...]) -> Any:
    """The tiny recipe composed by Hydra with these group choices (once per choice)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if groups not in _COMPOSED:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=pretrain_cli.RECIPES_DIR, version_base=None):
            _COMPOSED[groups] = compose(config_name="tiny", overrides=list(groups))
        GlobalHydra.instance().clear()
    return copy.deepcopy(_COMPOSED[groups])


def execute_composed(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """What `pretrain ARGS` does after Hydra composed: the overrides applied to the composed
    tiny recipe, then the CLI's `execute`, in `cwd`. (exit code, stdout, stderr)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    overrides = OverridesParser.create().parse_overrides(args)
    groups = tuple(o.input_line for o in overrides if o.key_or_group == "cluster")
    node = _composed(groups)
    with open_dict(node):
        for o in overrides:
            if o.key_or_group != "cluster":
                OmegaConf.update(node, o.key_or_group, o.value(), merge=True, force_add=True)
    out, err, old_cwd, code = io.StringIO(), io.StringIO(), os.getcwd(), 0
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cfg = to_recipe(node)
            cfg.run.dir = str(pretrain_cli._run_dir(cfg))
            pretrain_cli.execute(cfg)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(old_cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_refused_cleanly_and_writes_nothing(root: Path, case: Case) -> None:
    args = [a.replace("{root}", str(root)) for a in case.args]
    skip_if_not_applicable(Case(case.id, tuple(args), case.field))
    if not any(a.startswith("run.dir=") for a in args):
        args.append(f"run.dir={root}/run")
    before = tree(root)
    run = execute_composed if case.composed else pretrain_in_process
    code, out, err = (
        run(*args, cwd=root / "work") if not case.composed else run(args, root / "work")
    )
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in out + err
    assert case.field.replace("{root}", str(root)) in err, err[-3000:]
    assert SECRET not in out + err
    assert tree(root) == before, "something was written"


def test_the_suite_is_large_enough() -> None:
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "case_id",
    [
        "recipe_bomb",
        "deep_list_argument",
        "hydra_callbacks",
        "not_utf8_argument",
        "tree_pkg_hydra",
        "config_name_dotdot",
    ],
)
def test_a_real_pretrain_process_refuses_cleanly_and_quickly(root: Path, case_id: str) -> None:
    case = next(c for c in CASES if c.id == case_id)
    args = [a.replace("{root}", str(root)) for a in case.args]
    before = tree(root)
    start = time.monotonic()
    result = pretrain(*args, f"run.dir={root}/run", cwd=root / "work", timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert "Traceback" not in result.stdout + result.stderr
    assert case.field.replace("{root}", str(root)) in result.stderr
    assert tree(root) == before


# The tool's other commands read files a run dir holds (or any path given to them): each
# hostile file is refused with exit 2 naming it, or, for a metrics row that cannot be a
# step, skipped; never a traceback, a hang or a write.

CONFIG = "name: tiny\ntrain:\n  steps: 10\n"
FIFO = object()
"""A FIFO in place of the file: opening it for reading blocks until a writer comes."""


@dataclass(frozen=True)
class FileCase:
    id: str
    command: str
    """status, report or export."""
    files: dict[str, Any]
    """Run-dir files: text, bytes, FIFO, or a dict (a folder in place of the file)."""
    code: int
    named: str
    """Must appear in stderr (exit 2) or stdout (exit 0)."""


def file_case(case_id: str, command: str, code: int, named: str, **files: Any) -> FileCase:
    names = {"config_yaml": "config.yaml", "metrics_jsonl": "metrics.jsonl", "run_lock": LOCK_FILE}
    files = {"config.yaml": CONFIG, **{names.get(k, k): v for k, v in files.items()}}
    return FileCase(f"{command}_{case_id}", command, files, code, named)


ROW = '{"step": 3, "loss": 2.5}\n'
FILE_CASES = [
    # run.config.yaml: not a mapping, a section not a mapping, binary, a FIFO, a folder
    file_case("config_list", "status", 2, "config.yaml", config_yaml="- a\n- b\n"),
    file_case("config_train_list", "status", 2, "train", config_yaml="name: x\ntrain: [1]\n"),
    file_case("config_binary", "status", 2, "config.yaml", config_yaml=bytes(range(256))),
    file_case("config_fifo", "status", 2, "config.yaml", config_yaml=FIFO),
    file_case("config_folder", "status", 2, "config.yaml", config_yaml={}),
    file_case("config_bomb", "status", 2, "config.yaml", config_yaml=bomb()),
    file_case("steps_text", "status", 2, "train.steps", config_yaml="train:\n  steps: x\n"),
    # metrics rows that cannot be steps are skipped, the others shown
    file_case("step_null", "status", 0, "0/10", metrics_jsonl='{"step": null}\n'),
    file_case("step_huge", "status", 0, "3/10", metrics_jsonl=ROW + '{"step": 1e400}\n'),
    file_case("step_text", "status", 0, "3/10", metrics_jsonl=ROW + '{"step": "x"}\n'),
    file_case("step_bool", "status", 0, "3/10", metrics_jsonl=ROW + '{"step": true}\n'),
    file_case("row_list", "status", 0, "3/10", metrics_jsonl=ROW + "[1, 2]\n"),
    file_case("loss_text", "status", 0, "3/10", metrics_jsonl='{"step": 3, "loss": "x"}\n'),
    file_case("loss_infinite", "status", 0, "3/10", metrics_jsonl='{"step": 3, "loss": 1e999}\n'),
    file_case("metrics_binary", "status", 2, "metrics.jsonl", metrics_jsonl=b"\xff\xfe\x00"),
    file_case("metrics_fifo", "status", 2, "metrics.jsonl", metrics_jsonl=FIFO),
    file_case("lock_list", "status", 0, "3/10", metrics_jsonl=ROW, run_lock="[1, 2]"),
    file_case("slurm_binary", "status", 2, "slurm_job_id", slurm_job_id=b"\xff" * 8),
    file_case("slurm_not_an_id", "status", 0, "no job id", slurm_job_id="1; rm -rf ~\n"),
    # pretrain-report: the same rows, and an --out that is not a file to write
    file_case("step_null", "report", 2, "no logged step", metrics_jsonl='{"step": null}\n'),
    file_case("step_huge", "report", 2, "no logged step", metrics_jsonl='{"step": 1e400}\n'),
    file_case("metrics_binary", "report", 2, "metrics.jsonl", metrics_jsonl=bytes(range(256))),
    file_case("metrics_fifo", "report", 2, "metrics.jsonl", metrics_jsonl=FIFO),
    file_case("metrics_folder", "report", 2, "metrics.jsonl", metrics_jsonl={}),
    file_case("out_folder", "report", 2, "out", metrics_jsonl=ROW, out={}),
    file_case("out_fifo", "report", 2, "out", metrics_jsonl=ROW, out=FIFO),
    # pretrain-export reads the run's config.yaml before any checkpoint
    file_case("config_list", "export", 2, "config.yaml", config_yaml="- a\n"),
    file_case("config_binary", "export", 2, "config.yaml", config_yaml=bytes(range(256))),
    file_case("config_fifo", "export", 2, "config.yaml", config_yaml=FIFO),
    file_case("config_wrong_type", "export", 2, "train.steps", config_yaml="train:\n  steps: x\n"),
]


def make_files(run_dir: Path, files: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True)
    for name, content in files.items():
        path = run_dir / name
        if content is FIFO:
            os.mkfifo(path)
        elif isinstance(content, dict):
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def run_tool(command: str, run_dir: Path, cwd: Path) -> tuple[int, str, str]:
    """The command's console entry point in this process (its error boundary included)."""
    import sys

    out, err, argv, code = io.StringIO(), io.StringIO(), sys.argv, 0
    sys.argv = {
        "status": ["pretrain", "status", str(run_dir)],
        "report": ["pretrain-report", str(run_dir), "--out", str(run_dir / "out")],
        "export": ["pretrain-export", str(run_dir), str(cwd.parent / "exported")],
    }[command]
    entry = {"status": "pretrain", "report": "report", "export": "export"}[command]
    from pretrain.launcher import entry as entries

    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            getattr(entries, entry)()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("case", FILE_CASES, ids=[c.id for c in FILE_CASES])
def test_a_hostile_run_dir_file_is_refused_cleanly_or_skipped(root: Path, case: FileCase) -> None:
    run_dir = root / "files" / case.id
    make_files(run_dir, case.files)
    before = tree(root)
    code, out, err = run_tool(case.command, run_dir, root / "work")
    assert code == case.code, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in out + err
    assert case.named in (err if code else out), (out + err)[-2000:]
    if code:
        assert len(err.strip().splitlines()) <= 3, err  # a line or two, not a dump
    assert tree(root) == before, "something was written"


def test_there_is_a_file_case_for_every_command_and_kind() -> None:
    kinds = {(c.command, type(v).__name__ if v is not FIFO else "fifo") for c in FILE_CASES
             for v in c.files.values()}  # fmt: skip
    for command in ("status", "report", "export"):
        assert {(command, "fifo"), (command, "bytes"), (command, "str")} <= kinds


# The error boundary of the entry points, in real processes: a bug is one line naming the
# saved traceback, exit 1; Ctrl-C is one line, exit 130.


def test_an_unexpected_error_is_one_line_with_the_traceback_saved(root: Path) -> None:
    """A broken install (matplotlib that fails to import) while drawing a report."""
    broken = root / "broken_site"
    broken.mkdir(exist_ok=True)
    (broken / "matplotlib.py").write_text("raise RuntimeError('a broken matplotlib')\n")
    run_dir = root / "files" / "boundary_report"
    make_files(run_dir, {"config.yaml": CONFIG, "metrics.jsonl": ROW})
    temp = root / "tmp"
    temp.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        TMPDIR=str(temp),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(broken), os.environ.get("PYTHONPATH", "")]),
    )
    import sys

    command = [sys.executable, "-c", "from pretrain.launcher.entry import report; report()"]
    result = subprocess.run(
        [*command, str(run_dir)], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "pretrain-report: unexpected error" in line and "a broken matplotlib" in line
    [saved] = (temp / "pretrain-tracebacks").iterdir()
    assert str(saved) in line
    assert "Traceback" in saved.read_text() and "a broken matplotlib" in saved.read_text()
    assert not (run_dir / "report.png").exists()


@pytest.mark.parametrize("delay_s", [0.3, 1.0])
def test_ctrl_c_is_one_line_and_exit_130(root: Path, delay_s: float) -> None:
    """SIGINT while the command's modules load, or while it composes and plans (the
    boundary's own handling of KeyboardInterrupt is tests/unit/test_boundary.py's). The
    delay counts from the import of the boundary (`launcher/entry.py`, the command's first),
    which `-X importtime` reports: before it, in Python's own start-up, no program can take
    the signal, and on a loaded machine that start-up alone can outlast a fixed delay."""
    import signal
    import sys
    import threading

    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "pretrain", "-m", "seed=range(0,40)",
         "action=plan"],
        cwd=root / "work",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    lines: list[str] = []
    boundary = threading.Event()

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if line.rstrip().endswith("| pretrain.launcher.entry"):
                boundary.set()

    reader = threading.Thread(target=read_stderr)
    reader.start()
    assert boundary.wait(timeout=60), "".join(lines)[-2000:]
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    assert process.stdout is not None
    out = process.stdout.read()
    process.wait(timeout=60)
    reader.join(timeout=60)
    err = "".join(line for line in lines if not line.startswith("import time:"))
    if process.returncode == 0:
        pytest.skip("the plan finished before the signal came")
    # 130, or death by SIGINT after the line (the interpreter's own exit once the
    # KeyboardInterrupt was taken, seen on a loaded machine): a shell reports both as 130.
    assert process.returncode in (130, -signal.SIGINT), err[-2000:]
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "pretrain: interrupted (Ctrl-C); stopped"


def test_a_sweep_of_plans_writes_nothing(root: Path) -> None:
    """Hydra writes multirun.yaml before the first point; a plan promises to write nothing."""
    before = tree(root)
    code, out, err = pretrain_in_process("-m", "seed=1,2", "action=plan", cwd=root / "work")
    assert code == 0, err[-2000:]
    assert out.count("plan") >= 2 or "seed=2" in err
    assert tree(root) == before, "something was written"


def test_sigterm_to_the_launcher_stops_the_preparation_it_started(root: Path) -> None:
    """`action=prepare` owns its child and the child's tokenizer workers: SIGTERM to the
    launcher stops them all (none left writing into the cache), the finished units are kept
    for the next run, and the lock the preparation held is released."""
    import signal
    import sys

    from pretrain.dataprep.sources import MANIFEST
    from tests.helpers import generated_documents, live_processes, wait_until_gone, write_jsonl

    work = root / "prepare_stop"
    docs = generated_documents(24 * 400, seed=3)
    for i in range(24):
        write_jsonl(work / "corpus" / f"s{i:02d}.jsonl", docs[400 * i : 400 * (i + 1)])
    run_dir = work / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "pretrain", "action=prepare", f"run.dir={run_dir}",
         f"data.source={work / 'corpus'}", f"data.cache_dir={work / 'cache'}",
         "data.workers=2", "model.vocab_size=512", "data.val_fraction=0", "eval.every=0"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    config = str(run_dir / "prepare.yaml")
    deadline = time.monotonic() + 60
    while not live_processes(mentioning=config) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        time.sleep(0.05)
    assert live_processes(mentioning=config), "the preparation never started"
    time.sleep(1.0)  # into the tokenizer's training or the workers' units
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert wait_until_gone(mentioning=config, seconds=5) == [], "a child outlived the launcher"
    assert "Traceback" not in out + err
    folders = [p for p in (work / "cache" / "datasets").glob("*") if p.is_dir()]
    if process.returncode == 0:
        pytest.skip("the preparation finished before the signal came")
    assert process.returncode in (143, 130, 2), err[-2000:]
    assert not any((f / MANIFEST).exists() for f in folders), "it went on to the end"
    assert not (run_dir / LOCK_FILE).exists()
