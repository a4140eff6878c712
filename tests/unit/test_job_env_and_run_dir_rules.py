"""What the job's environment and run dir may be: no secrets or script-changing variables
in cluster.env, no secret values anywhere, cluster numbers in range, a device that exists,
a run dir of its own; and a schedule longer than the run is shortened, not refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pretrain.core.problems import Checks, Problem
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.env import HIDDEN, check_env, check_local_device
from pretrain.launcher.validate.rundir import check_run_dir
from pretrain.launcher.validate.schedules import fit_schedule_to_run


def env_problems(cfg: RecipeConfig, environ: dict[str, str] | None = None) -> list[Problem]:
    c = Checks()
    check_env(c, cfg, environ or {})
    return c.problems


def with_env(**env: str) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.cluster.env = dict(env)
    return cfg


@pytest.mark.parametrize(
    "name", ["WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_KEY", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY",
             "GITHUB_TOKEN", "api_key", "MY_CREDENTIALS"],
)  # fmt: skip
def test_secret_names_are_refused_and_their_values_never_shown(name: str) -> None:
    [problem] = env_problems(with_env(**{name: "s3cr3t-value"}))
    assert problem.field == f"cluster.env.{name}" and problem.value == HIDDEN
    assert "s3cr3t-value" not in str(problem)
    assert f"export {name} in the environment you launch from" in problem.fix


@pytest.mark.parametrize(
    "name", ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "BASH_ENV", "ENV", "PYTHONPATH",
             "PYTHONSTARTUP", "BASH_FUNC_x%%", "SHELLOPTS"],
)  # fmt: skip
def test_variables_that_change_how_the_job_script_starts_are_refused(name: str) -> None:
    [problem] = env_problems(with_env(**{name: "/tmp/x"}))
    assert problem.field == f"cluster.env.{name}"


def test_library_settings_pass_and_omp_threads_must_be_positive() -> None:
    assert env_problems(with_env(NCCL_DEBUG="INFO", UCX_TLS="rc", OMP_NUM_THREADS="4")) == []
    [problem] = env_problems(with_env(OMP_NUM_THREADS="0"))
    assert problem.field == "cluster.env.OMP_NUM_THREADS"


def test_torchruns_own_variables_are_refused() -> None:
    cfg = with_env(RANK="1", MASTER_PORT="1", TORCHELASTIC_X="1")
    fields = [p.field for p in env_problems(cfg)]
    assert fields == ["cluster.env.RANK", "cluster.env.MASTER_PORT", "cluster.env.TORCHELASTIC_X"]


def test_the_value_of_a_secret_variable_is_refused_in_any_field() -> None:
    cfg = with_env(MY_VAR="token-abcdef123")
    cfg.logging.wandb_project = "proj-token-abcdef123"
    found = env_problems(cfg, {"HF_TOKEN": "token-abcdef123", "SHORT_KEY": "abc"})
    assert [p.field for p in found] == ["cluster.env.MY_VAR", "logging.wandb_project"]
    assert all(p.value == HIDDEN and "$HF_TOKEN" in p.reason for p in found)


@pytest.mark.parametrize(
    ("field", "value"),
    [("master_port", -1), ("master_port", 70000), ("cpus_per_task", 0), ("signal_seconds", -5),
     ("omp_num_threads", 0)],
)  # fmt: skip
def test_cluster_numbers_out_of_range_are_refused(field: str, value: int) -> None:
    cfg = RecipeConfig()
    setattr(cfg.cluster, field, value)
    assert [p.field for p in env_problems(cfg)] == [f"cluster.{field}"]


@pytest.mark.skipif(Path("/proc/driver/nvidia/gpus").exists(), reason="this machine has CUDA")
def test_a_local_cuda_run_on_a_machine_without_cuda_is_refused() -> None:
    c = Checks()
    check_local_device(c, RecipeConfig())
    assert [p.field for p in c.problems] == ["cluster.device"]
    cpu = RecipeConfig()
    cpu.cluster.device = "cpu"
    check_local_device(c, cpu)
    assert len(c.problems) == 1


def run_dir_problems(raw: str) -> list[Problem]:
    cfg = RecipeConfig()
    cfg.run.dir = raw
    c = Checks()
    check_run_dir(c, cfg)
    return c.problems


def test_special_directories_files_and_foreign_folders_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_text("x")
    expected = {
        "/": "is the root directory",
        "~": "is your home directory",
        ".": "is the current directory",
        "notes.txt": "is a file, not a directory",
        "photos": "holds other files (a.jpg) and no config.yaml",
        "notes.txt/run": "is a file, so nothing can be created under it",
        "x" * 300: "a name in it is 300 bytes",
        "/a" * 3000: "more than the 4096 a path may have",
    }
    for raw, reason in expected.items():
        [problem] = run_dir_problems(raw)
        assert reason in problem.reason, (raw[:20], problem)


def test_a_run_dir_an_empty_dir_and_a_new_path_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "old_run").mkdir()
    (tmp_path / "old_run" / "config.yaml").write_text("{}")
    (tmp_path / "old_run" / "metrics.jsonl").write_text("")
    (tmp_path / "empty").mkdir()
    for raw in ("old_run", "empty", "new/deeper"):
        assert run_dir_problems(str(tmp_path / raw)) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only file system needs root")
def test_a_run_dir_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("mount is not permitted here")
    try:
        [problem] = run_dir_problems(str(ro / "run"))
        assert "is on a read-only file system" in problem.reason
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_warmup_longer_than_the_run_is_shortened_with_a_warning() -> None:
    cfg = RecipeConfig()
    cfg.train.steps, cfg.schedule.warmup_steps, cfg.schedule.decay_steps = 5, 20, 10
    warnings = fit_schedule_to_run(cfg)
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay_steps) == (5, 0)
    assert warnings == [
        "schedule.warmup_steps=20 is longer than train.steps=5; warming up over all 5 steps "
        "instead",
        "schedule.warmup_steps + decay_steps = 15 is longer than train.steps=5; decaying over "
        "the remaining 0 steps instead",
    ]


def test_a_schedule_that_fits_or_is_invalid_is_left_alone() -> None:
    cfg = RecipeConfig()
    cfg.train.steps, cfg.schedule.warmup_steps, cfg.schedule.decay_steps = 100, 10, 90
    assert fit_schedule_to_run(cfg) == []
    cfg.schedule.warmup_steps = -1
    assert fit_schedule_to_run(cfg) == [] and cfg.schedule.warmup_steps == -1
