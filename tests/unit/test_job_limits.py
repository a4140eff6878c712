"""A SLURM job's settings against each other and its partition, and a run's checkpoints
against its disk: each contradiction is refused naming the field, before anything is
written; what SLURM cannot tell here is skipped with a line."""

from __future__ import annotations

import shutil
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path

import pytest

from pretrain.core.problems import Checks, Problem
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate import job_limits
from pretrain.launcher.validate.job_limits import (
    CHECKPOINT_WRITE_GBS,
    SAVE_MARGIN_S,
    check_disk_room,
    check_partition,
    check_signal_lead,
    checkpoint_bytes,
    checkpoints_at_once,
    partition_limits,
    slurm_seconds,
)
from pretrain.models.flops import count_params
from tests.helpers import base

SCONTROL = (
    "PartitionName=gpu AllowGroups=ALL Default=YES MaxNodes=4 MaxTime=2-00:00:00 "
    "TotalNodes=16 TotalCPUs=1024 State=UP\n"
)
SINFO = "64|gpu:h100:8(S:0-1)\n96+|gpu:8\n"


def slurm_cfg(**cluster: object) -> RecipeConfig:
    cfg = base()
    cfg.cluster.backend = "slurm"
    for name, value in cluster.items():
        setattr(cfg.cluster, name, value)
    return cfg


def fake_slurm(argv: list[str]) -> str | None:
    return SCONTROL if argv[0] == "scontrol" else SINFO


def found(check: Callable[..., object], cfg: RecipeConfig, *args) -> list[Problem]:
    c = Checks()
    check(c, cfg, *args)
    return c.problems


def test_time_limits_read_as_sbatch_reads_them() -> None:
    cases = {"30": 1800, "30:15": 1815, "04:00:00": 14400, "2-00": 172800,
             "1-02:03": 93780, "1-00:00:01": 86401, "UNLIMITED": None, "0": None,
             "00:00:00": None, "soon": None}  # fmt: skip
    assert {text: slurm_seconds(text) for text in cases} == cases


def test_a_checkpoint_is_sized_as_fp32_weights_and_the_optimizers_states() -> None:
    cfg = base()
    params = count_params(cfg.model).total
    assert checkpoint_bytes(cfg) == params * (4 + 2 * 4)  # AdamW: two FP32 moments
    cfg.optim.state_dtype = "bf16"
    assert checkpoint_bytes(cfg) == params * (4 + 2 * 2)


def test_a_stop_signal_before_the_job_starts_would_requeue_it_for_ever() -> None:
    [problem] = found(check_signal_lead, slurm_cfg(time="10", signal_seconds=600))
    assert problem.field == "cluster.signal_seconds" and "for ever" in problem.reason
    assert "cluster.time=10 (600 s)" in problem.reason and "below 600 s" in problem.fix


def test_a_stop_signal_shorter_than_the_save_is_refused_with_the_lead_that_fits() -> None:
    cfg = slurm_cfg(time="48:00:00", signal_seconds=60)
    cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim = 8192, 80, 28672  # 70B-like
    save = checkpoint_bytes(cfg) / (CHECKPOINT_WRITE_GBS * 1e9)
    [problem] = found(check_signal_lead, cfg)
    assert problem.field == "cluster.signal_seconds" and "killed mid-save" in problem.reason
    assert problem.fix == f"use cluster.signal_seconds >= {int(-(-save // 1)) + SAVE_MARGIN_S}"
    cfg.cluster.nodes = 64  # more writers: the save is shorter than the lead
    assert found(check_signal_lead, cfg) == []
    assert found(check_signal_lead, slurm_cfg(backend="local", time="1", signal_seconds=600)) == []


def test_the_partitions_limits_refuse_what_would_pend_for_ever() -> None:
    limits = partition_limits("", fake_slurm)
    assert limits is not None and (limits.name, limits.max_seconds) == ("gpu", 172800)
    assert (limits.max_nodes, limits.cpus_per_node, limits.gpus_per_node) == (4, 96, 8)
    cfg = slurm_cfg(time="3-00:00:00", nodes=8, cpus_per_task=128, gpus_per_node=16)
    assert [p.field for p in found(check_partition, cfg, fake_slurm)] == [
        "cluster.time", "cluster.nodes", "cluster.cpus_per_task", "cluster.gpus_per_node",
    ]  # fmt: skip
    assert found(check_partition, slurm_cfg(time="UNLIMITED"), fake_slurm)[0].fix.startswith(
        "use cluster.time <= 172800 s"
    )
    assert found(check_partition, slurm_cfg(time="1-00:00:00", nodes=4), fake_slurm) == []


def test_a_partition_slurm_cannot_describe_is_skipped_with_a_line() -> None:
    c = Checks()
    line = check_partition(c, slurm_cfg(partition="gpu"), lambda argv: None)
    assert c.problems == [] and line is not None
    assert line.startswith("cluster.partition=gpu's limits not checked")
    assert partition_limits("", lambda argv: "PartitionName=cpu Default=NO\n") is None


def test_checkpoints_at_once_are_those_kept_and_the_one_written_but_no_more_than_saved() -> None:
    cfg = base()
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.keep = 1000, 100, 2
    assert checkpoints_at_once(cfg) == 3
    cfg.train.steps = 150
    assert checkpoints_at_once(cfg) == 2
    cfg.checkpoint.every = 0
    assert checkpoints_at_once(cfg) == 1


def test_a_disk_that_cannot_hold_the_checkpoints_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = base()
    cfg.run.dir = str(tmp_path / "run")
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.keep = 1000, 100, 2
    usage = namedtuple("usage", "total used free")
    need = 3 * checkpoint_bytes(cfg) * job_limits.DISK_MARGIN
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, int(need) - 1))
    [problem] = found(check_disk_room, cfg)
    assert problem.field == "checkpoint.keep" and f"run.dir={cfg.run.dir}" in problem.reason
    assert "3 checkpoint(s)" in problem.reason and "lower checkpoint.keep" in problem.fix
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, int(need) + 1))
    assert found(check_disk_room, cfg) == []


def test_the_hugging_face_folders_of_hf_every_count_towards_the_room_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pretrain.models.flops import count_params

    cfg = base()
    cfg.run.dir = str(tmp_path / "run")
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.keep = 1000, 100, 2
    cfg.checkpoint.hf_every = 250
    weights = count_params(cfg.model).total * 4
    assert job_limits.hf_folder_bytes(cfg) == 4 * weights  # 2 kept, 1 written twice over
    usage = namedtuple("usage", "total used free")
    need = (3 * checkpoint_bytes(cfg) + 4 * weights) * job_limits.DISK_MARGIN
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, int(need) - 1))
    [problem] = found(check_disk_room, cfg)
    assert "Hugging Face folders of" in problem.reason
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, int(need) + 1))
    assert found(check_disk_room, cfg) == []
