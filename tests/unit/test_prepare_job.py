"""`action=prepare` as a SLURM job: CPU-only, sized by data.workers, on the CPU partition,
quoted like every job script; and a SLURM run's ranks refuse data nobody prepared."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from pretrain.core.run.rundir import PREPARE_CONFIG, PREPARE_SCRIPT
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.launcher.job.prepare import render_prepare_sbatch, write_prepare_files
from pretrain.launcher.job.run_dir import JobError
from pretrain.trainer.data.loader import DataNotPrepared, open_datasets


def slurm_recipe(tmp_path: Path) -> RecipeConfig:
    cfg = RecipeConfig(name="big")
    cfg.cluster.backend, cfg.cluster.partition, cfg.cluster.account = "slurm", "gpu", "proj"
    cfg.cluster.cpu_partition = "cpu"
    cfg.data.workers = 12
    cfg.data.cache_dir = str(tmp_path / "cache")
    return cfg


def test_the_prepare_job_asks_for_cpus_on_the_cpu_partition_and_no_gpus(tmp_path: Path) -> None:
    cfg = slurm_recipe(tmp_path)
    script = render_prepare_sbatch(cfg, tmp_path, tmp_path / "prepare.yaml")
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --cpus-per-task=12" in lines
    assert '#SBATCH --partition="cpu"' in lines and '#SBATCH --account="proj"' in lines
    assert not [line for line in lines if "gpu" in line.lower() and "partition" not in line]
    assert '#SBATCH --job-name="big-prepare"' in lines
    config = shlex.quote(str(tmp_path / "prepare.yaml"))
    assert f"{shlex.quote(sys.executable)} -m pretrain.dataprep.prepare {config}" in script
    cfg.cluster.cpu_partition, cfg.data.workers = "", 0
    script = render_prepare_sbatch(cfg, tmp_path, tmp_path / "prepare.yaml")
    assert '#SBATCH --partition="gpu"' in script
    assert f"#SBATCH --cpus-per-task={cfg.cluster.cpus_per_task}" in script


def test_prepare_files_hold_the_recipe_and_leave_the_runs_config_alone(tmp_path: Path) -> None:
    cfg = slurm_recipe(tmp_path)
    files = write_prepare_files(cfg, tmp_path / "run")
    assert files.config_path.name == PREPARE_CONFIG and files.script_path.name == PREPARE_SCRIPT
    assert load_config(str(files.config_path)).data.workers == 12
    assert not (tmp_path / "run" / "config.yaml").exists()
    cfg.cluster.cpu_partition = "cpu\nrm -rf /"
    with pytest.raises(JobError, match=r"cluster\.cpu_partition"):
        write_prepare_files(cfg, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_the_ranks_of_a_slurm_run_refuse_unprepared_data_with_the_command(tmp_path: Path) -> None:
    cfg = slurm_recipe(tmp_path)
    with pytest.raises(DataNotPrepared, match="prepare it first with the same command and action="):
        open_datasets(cfg, is_main=True, report=print)
    assert not (tmp_path / "cache").exists()  # nothing tokenized
