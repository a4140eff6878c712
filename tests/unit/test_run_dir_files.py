"""The files the launcher writes into a run dir: modes under the user's umask, untouched when
unchanged, a one-line error when the disk refuses, the plan beside the config, and a config
that reads back to the recipe it was written from."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from pretrain.core.inputs.reading import ReadError
from pretrain.core.run.rundir import PLAN_FILE
from pretrain.core.schema import RecipeConfig, dump_config, load_config
from pretrain.launcher.job.run_dir import JobError, render_sbatch, write_run_dir


def local_recipe(run_dir: Path) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.cluster.device = "cpu"
    cfg.run.dir = str(run_dir)
    return cfg


def test_files_honour_the_umask(tmp_path: Path) -> None:
    cfg = local_recipe(tmp_path / "run")
    previous = os.umask(0o077)
    try:
        files = write_run_dir(cfg, tmp_path / "run", dump_config(cfg), {"memory_gib": 1.0})
    finally:
        os.umask(previous)
    for path in (files.config_path, files.script_path, files.run_dir / PLAN_FILE):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    assert stat.S_IMODE(files.script_path.stat().st_mode) == 0o700


def test_an_unchanged_run_dir_is_not_rewritten(tmp_path: Path) -> None:
    cfg = local_recipe(tmp_path / "run")
    files = write_run_dir(cfg, tmp_path / "run", dump_config(cfg), {"memory_gib": 1.0})
    before = {p: p.stat().st_mtime_ns for p in files.run_dir.iterdir()}
    os.utime(files.script_path, ns=(1, 1))
    write_run_dir(cfg, tmp_path / "run", dump_config(cfg), {"memory_gib": 1.0})
    assert files.script_path.stat().st_mtime_ns == 1
    assert {p: p.stat().st_mtime_ns for p in files.run_dir.iterdir() if p != files.script_path} == {
        p: t for p, t in before.items() if p != files.script_path
    }


def test_a_full_disk_is_a_one_line_job_error(tmp_path: Path, monkeypatch) -> None:
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run"))

    monkeypatch.setattr("tempfile.mkstemp", no_space)
    cfg = local_recipe(tmp_path / "run")
    with pytest.raises(JobError) as error:
        write_run_dir(cfg, tmp_path / "run", dump_config(cfg))
    assert str(error.value).startswith(
        f"cannot write the run dir {tmp_path / 'run'}: No space left on device;"
    )
    assert "\n" not in str(error.value)


def test_omp_num_threads_from_cluster_env_reaches_the_sbatch_script() -> None:
    cfg = RecipeConfig()
    cfg.cluster.backend = "slurm"
    cfg.cluster.env = {"OMP_NUM_THREADS": "7", "NCCL_DEBUG": "WARN"}
    script = render_sbatch(cfg, Path("/runs/a"), Path("/runs/a/config.yaml"))
    assert "export OMP_NUM_THREADS=7\n" in script
    assert "export NCCL_DEBUG=WARN" in script


@pytest.mark.parametrize(
    "text",
    ["${oc.env:HF_TOKEN}", "\\${x}", "a\\\\${b}", "${", "$HOME", "tab\tand\nnewline", "ünï"],
)
def test_the_written_config_reads_back_to_the_same_recipe(tmp_path: Path, text: str) -> None:
    cfg = RecipeConfig()
    cfg.data.text_field = text
    cfg.cluster.env = {"NCCL_SOCKET_IFNAME": text}
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("text", ["0", "tiny", "true"])
def test_a_config_of_one_value_is_a_read_error_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ReadError, match=f"holds the single value '{text}', not a mapping"):
        load_config(str(path))
