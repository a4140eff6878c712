"""The `pretrain` command as a user drives it: compose, override, plan, script, run."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

import pytest
import yaml

from tests.distributed.harness import BASE_OVERRIDES, read_curve
from tests.helpers import RECIPES, pretrain

pytestmark = pytest.mark.e2e


def test_every_shipped_recipe_composes_validates_and_plans(tmp_path: Path) -> None:
    assert {"tiny", "gpt2_124m", "llama3_1b", "llama3_8b", "llama3_70b"} <= set(RECIPES)
    for recipe in RECIPES:
        result = pretrain("--config-name", recipe, "action=plan", "plan.format=json", cwd=tmp_path)
        assert result.returncode == 0, f"{recipe}: {result.stderr}"
        plan = json.loads(result.stdout)
        assert plan["params_total"] > 0 and plan["memory_gib"] > 0


def test_plan_writes_nothing(tmp_path: Path) -> None:
    result = pretrain("action=plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tiny" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_llama3_70b_json_plan_has_layout_params_flops_and_memory(tmp_path: Path) -> None:
    # A key before the flag and others after it, as plain Hydra users write them.
    result = pretrain(
        "cluster.nodes=8",
        "--config-name",
        "llama3_70b",
        "action=plan",
        "plan.format=json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert abs(plan["params_total"] / 70.6e9 - 1) < 0.01
    assert plan["degrees"]["tp"] == 8 and plan["degrees"]["world"] == 64
    assert plan["rank_groups"]["tp"][0] == list(range(8))
    # 6 FLOPs per parameter and token, plus attention scores at 8192 tokens.
    assert plan["flops_per_token_train"] > 6 * plan["params_non_embedding"]
    assert 0 < plan["memory_gib"] < plan["gpu_memory_gib"]


def test_script_writes_config_and_sbatch_without_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = pretrain(
        "--config-name",
        "llama3_70b",
        "cluster=slurm",
        "cluster.nodes=8",
        "action=script",
        f"run.dir={run_dir}",
        "cluster.partition=gpu",
        "cluster.account=proj",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["parallel"]["tp"] == 8 and config["cluster"]["nodes"] == 8
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=8" in script
    assert '#SBATCH --partition="gpu"' in script
    assert str(run_dir / "job.sbatch") in result.stdout
    assert not (run_dir / "metrics.jsonl").exists()


def test_config_is_fully_resolved_for_the_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = pretrain("action=script", f"run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text
    assert yaml.safe_load(text)["run"]["dir"] == str(run_dir)


def test_cfg_job_prints_the_composed_recipe(tmp_path: Path) -> None:
    result = pretrain("--cfg", "job", "model.dim=256", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["model"]["dim"] == 256


def test_unknown_key_fails_at_compose_time(tmp_path: Path) -> None:
    result = pretrain("action=plan", "model.hidden=3", cwd=tmp_path)
    assert result.returncode != 0
    assert "hidden" in result.stderr


def test_wrong_type_fails_at_compose_time(tmp_path: Path) -> None:
    result = pretrain("action=plan", "train.steps=many", cwd=tmp_path)
    assert result.returncode != 0
    assert "train.steps" in result.stderr and "many" in result.stderr


def test_all_validation_problems_reported_before_anything_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = pretrain(
        "parallel.dp_shard=3",
        "model.n_layers=0",
        "optim.lr=-1",
        f"run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    for field in ("parallel.dp_shard=3", "model.n_layers=0", "optim.lr=-1"):
        assert field in result.stderr
    assert not run_dir.exists()


def test_multirun_writes_one_run_dir_per_point(tmp_path: Path) -> None:
    result = pretrain("-m", "action=script", "seed=1,2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dirs = sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir() if p.is_dir())
    assert dirs == ["seed=1", "seed=2"]
    seeds = [
        yaml.safe_load((tmp_path / "runs/tiny" / d / "config.yaml").read_text())["seed"]
        for d in dirs
    ]
    assert seeds == [1, 2]
    assert (tmp_path / "runs/tiny/multirun.yaml").is_file()
    # Given a run.dir, the sweep's own record goes there too, and nothing to runs/.
    again = pretrain("-m", "action=script", "seed=1,2", "run.dir=sweeps/seeds", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "sweeps/seeds/multirun.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "sweeps/seeds").iterdir() if p.is_dir()) == dirs
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny"]


@pytest.mark.slow
def test_default_recipe_trains_end_to_end_on_two_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The user's own folders named like ours, where the job runs, stand in for nothing.
    for name in ("pretrain", "models", "parallel", "trainer", "launcher", "core", "dataprep"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user {name}')\n")
    # The recipe's own evaluation: every 100 steps and at the end, so at step 30.
    overrides = [
        o for o in BASE_OVERRIDES if not o.startswith(("train.steps", "logging.", "eval."))
    ]
    result = pretrain(
        "-v",  # the command it runs is said
        *overrides,
        "train.steps=30",
        "logging.log_every=10",
        "logging.wandb=offline",
        f"run.dir={run_dir}",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu"):
        assert key in rows[0]
    # The node's system figures, sampled at the first logged step (then every 60 s).
    host = socket.gethostname()
    assert 0 <= rows[0][f"system/{host}/cpu_util"] <= 100
    assert rows[0][f"system/{host}/mem_used_gib"] > 0
    # The step breakdown: its regions lie inside the step.
    regions = ("time_forward_s", "time_backward_s", "time_optimizer_s", "data_wait_s")
    assert 0 < sum(rows[-1][k] for k in regions) <= rows[-1]["step_time_s"]
    assert rows[-1]["time_blocked_s"] >= 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "val_loss" not in rows[0] and rows[-1]["val_loss"] > 0
    assert f"val loss {rows[-1]['val_loss']:.4f}" in result.stdout
    [ran] = [line for line in result.stderr.splitlines() if line.startswith("debug: running: ")]
    assert ran.startswith(f"debug: running: {sys.executable} -m pretrain.trainer.agent ")
    assert ran.endswith(f" -m pretrain.trainer {run_dir / 'config.yaml'}")
    assert read_curve(run_dir / "metrics.jsonl").loss == [r["loss"] for r in rows]
    assert (run_dir / "wandb_run_id").exists()
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_version_names_this_package_and_what_it_drives(tmp_path: Path) -> None:
    from importlib.metadata import version

    from tests.helpers import pretrain_in_process

    code, out, _ = pretrain_in_process("action=plan", "--version", cwd=tmp_path)
    assert code == 0
    assert out.startswith(f"pretrain {version('pretrain')} (torch {version('torch')}, hydra-core ")
    assert list(tmp_path.iterdir()) == []


def test_the_wandb_project_comes_from_the_recipe_else_wandb_project_and_is_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers import pretrain_in_process

    def project(*overrides: str) -> str:
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        code, _, err = pretrain_in_process(
            "action=script", f"run.dir={run_dir}", *overrides, cwd=tmp_path
        )
        assert code == 0, err
        return yaml.safe_load((run_dir / "config.yaml").read_text())["logging"]["wandb_project"]

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert project() == "pretrain"
    monkeypatch.setenv("WANDB_PROJECT", "team-runs")
    assert project() == "team-runs"
    assert project("logging.wandb_project=mine") == "mine"


def test_a_run_prints_the_plan_in_a_few_lines_unless_asked_for_all_or_none(tmp_path: Path) -> None:
    from tests.helpers import pretrain_in_process

    def before_job(*overrides: str) -> list[str]:
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        code, out, err = pretrain_in_process(
            "action=script", f"run.dir={run_dir}", *overrides, cwd=tmp_path
        )
        assert code == 0, err
        assert out == f"{run_dir / 'run.sh'}\n"  # stdout: the script's path alone
        return err[: err.index("run dir:")].splitlines()

    summary = before_job()
    assert summary[0].startswith("plan: tiny on 2 ranks (dp_shard=2), 1.84M")
    assert "memory per rank" in summary[1] and len(summary) <= 4
    full = before_job("plan.before_run=full")
    assert any("Fit and speed" in line for line in full) and len(full) > 30
    assert before_job("plan.before_run=none") == []


def test_quiet_prints_only_warnings_and_what_was_asked_for(tmp_path: Path) -> None:
    from pretrain.launcher.output import LOGGER_NAME
    from tests.helpers import pretrain_in_process

    run_dir = tmp_path / "run"
    # train.steps=5 is shorter than the warm-up: a warning that -q must still show.
    code, out, err = pretrain_in_process(
        "-q", "action=script", f"run.dir={run_dir}", "train.steps=5", cwd=tmp_path
    )
    assert code == 0, err
    assert out == f"{run_dir / 'run.sh'}\n"
    assert err.splitlines() == [
        "warning: schedule.warmup_steps=20 is longer than train.steps=5; warming up over all "
        "5 steps instead"
    ]
    code, out, err = pretrain_in_process(
        "action=plan", "plan.format=json", "train.steps=5", "--quiet", cwd=tmp_path
    )
    assert code == 0 and json.loads(out)["name"] == "tiny"
    assert [line[:9] for line in err.splitlines()] == ["warning: "]
    code, out, err = pretrain_in_process("-q", "status", str(run_dir), cwd=tmp_path)
    assert code == 0 and out.startswith(f"{run_dir}\n") and err == ""
    # -q was that command's: code that runs the launcher's steps in this process afterwards
    # (cli.execute) says what it does again.
    assert logging.getLogger(LOGGER_NAME).level == logging.INFO


def test_verbose_adds_debug_lines_on_stderr_and_keeps_stdout_parseable(tmp_path: Path) -> None:
    from tests.helpers import pretrain_in_process

    code, out, err = pretrain_in_process(
        "-v", "action=plan", "plan.format=json", "model.n_layers=3", cwd=tmp_path
    )
    assert code == 0, err
    assert json.loads(out)["name"] == "tiny"
    debug = [line for line in err.splitlines() if line.startswith("debug: ")]
    assert debug[0].startswith("debug: Hydra's command line: action=plan plan.format=json ")
    assert "hydra/job_logging=none" in debug[0]  # what the launcher adds, said
    assert (
        debug[1] == "debug: recipe tiny, overrides: action=plan plan.format=json model.n_layers=3"
    )
    code, _, err = pretrain_in_process("-q", "-v", "action=plan", cwd=tmp_path)
    assert code == 2
    assert "verbosity='-q -v': -q shows warnings only and -v adds debug lines" in err
    assert list(tmp_path.iterdir()) == []


def test_status_report_export_and_dashboard_are_commands_of_pretrain(tmp_path: Path) -> None:
    from pretrain.launcher.dashboard import spec
    from tests.helpers import pretrain_in_process

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    row = {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 10.0, "grad_norm": 1.0}
    (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    code, out, _ = pretrain_in_process("report", str(run_dir), cwd=tmp_path)
    assert code == 0 and out.strip() == str(run_dir / "report.png")
    code, _, err = pretrain_in_process("status", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert code == 2 and "pretrain status" in err
    code, out, _ = pretrain_in_process("dashboard", "--print", cwd=tmp_path)
    assert code == 0 and json.loads(out) == json.loads(json.dumps(spec()))
    # The exporter runs in a process of its own (the launcher imports no trainer code).
    exported = pretrain("export", str(run_dir), str(tmp_path / "hf"), cwd=tmp_path)
    assert exported.returncode != 0 and "pretrain-export:" in exported.stderr
    code, out, _ = pretrain_in_process("--help", cwd=tmp_path)
    assert "pretrain export RUN_DIR OUT_DIR" in out


def test_a_script_of_a_layout_the_trainer_cannot_run_says_so_loudly(tmp_path: Path) -> None:
    from tests.helpers import pretrain_in_process

    code, _, err = pretrain_in_process(
        "parallel.pp=2", "parallel.pp_schedule=zero_bubble", "recompute.policy=selective",
        "cluster.gpus_per_node=4", "action=script", f"run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert code == 0 and (tmp_path / "run" / "run.sh").is_file()
    assert "warning: recompute.policy=selective: zero_bubble runs each micro-batch's" in err
