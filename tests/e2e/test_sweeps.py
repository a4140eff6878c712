"""Sweeps (-m): every point runs and is reported, and a sweeper plugin gets each point's
final loss to search on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from pretrain.launcher.job.sweep import MAX_POINT_NAME, final_loss, point_dir_name
from tests.distributed.harness import BASE_OVERRIDES, read_curve
from tests.helpers import pretrain

pytestmark = pytest.mark.e2e


def test_a_failing_point_is_reported_and_the_sweep_goes_on_then_exits_non_zero(
    tmp_path: Path,
) -> None:
    result = pretrain("-m", "model.n_heads=3,4", "action=plan", "plan.format=json", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.count('"params_total"') == 1  # the second point planned
    summary = result.stderr[result.stderr.index("sweep: 2 points") :].splitlines()
    assert summary[0] == "sweep: 2 points, 1 ok, 1 failed"
    assert re.split(r"\s{2,}", summary[1].strip()) == ["#", "status", "loss", "overrides", "why"]
    failed, ok = (re.split(r"\s{2,}", row.strip()) for row in summary[3:5])
    assert failed[:3] == ["#0", "FAILED", "model.n_heads=3"]
    assert failed[3].startswith("model.dim=128: not divisible by model.n_heads=3")
    assert ok == ["#1", "ok", "model.n_heads=4"]  # a plan measures no loss


def test_a_long_override_string_gives_a_short_stable_point_dir() -> None:
    task = ["optim.lr=0.001", *(f"+cluster.env.VAR{i}=x" * 3 for i in range(20))]
    long = ",".join(sorted(task))
    name = point_dir_name(long, task, 0)
    assert len(name.encode()) <= MAX_POINT_NAME
    assert name == point_dir_name(long, task, 0) != point_dir_name(long + "x", task, 0)
    assert point_dir_name("seed=1", ["seed=1"], 0) == "seed=1"


def test_the_final_loss_is_the_last_validation_loss_else_the_last_training_loss(
    tmp_path: Path,
) -> None:
    rows = [{"step": 1, "loss": 3.0, "val_loss": 3.5}, {"step": 2, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert final_loss(tmp_path) == 3.5
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    assert final_loss(tmp_path) == 2.5
    assert final_loss(tmp_path / "none") is None


@pytest.mark.slow
def test_an_optuna_search_of_two_trials_gets_each_trials_final_validation_loss(
    tmp_path: Path,
) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[dev]'")
    replaced = ("train.steps", "eval.every", "optim.lr")
    shrunk = [o for o in BASE_OVERRIDES if not o.startswith(replaced)]
    result = pretrain(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.sampler.seed=0", "optim.lr=interval(1e-3,1e-2)", *shrunk,
        "model.n_layers=2", "train.steps=2", "eval.every=2", "cluster.gpus_per_node=1",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "tiny"
    points = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(points) == 2 and all(p.name.startswith("optim.lr=") for p in points)
    losses = {}
    for point in points:
        launched = yaml.safe_load((point / "overrides.yaml").read_text())
        assert launched["recipe"] == "tiny" and "hydra/sweeper=optuna" not in launched["overrides"]
        [lr] = [o for o in launched["overrides"] if o.startswith("optim.lr=")]
        losses[float(lr.split("=")[1])] = read_curve(point / "metrics.jsonl").val_loss[-1]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert math.isclose(best["best_value"], min(losses.values()), rel_tol=1e-12)
    assert losses[best["best_params"]["optim.lr"]] == min(losses.values())
    assert "sweep: 2 points, 2 ok, 0 failed" in result.stderr


def test_each_sweep_point_is_a_named_wandb_run_in_one_group_per_sweep(tmp_path: Path) -> None:
    result = pretrain("-m", "seed=1,2", "action=script", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sweep_dir = tmp_path / "runs" / "tiny"
    configs = [yaml.safe_load((sweep_dir / f"seed={n}/config.yaml").read_text()) for n in (1, 2)]
    assert [c["logging"]["wandb_name"] for c in configs] == ["tiny seed=1", "tiny seed=2"]
    assert {c["logging"]["wandb_group"] for c in configs} == {"tiny:seed"}


@pytest.mark.parametrize("where", ["cluster.backend=slurm", "action=script"])
def test_an_optuna_search_whose_trials_train_nothing_here_is_refused_before_its_first(
    tmp_path: Path, where: str
) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[dev]'")
    from tests.helpers import pretrain_in_process

    code, _, err = pretrain_in_process(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "optim.lr=interval(1e-4,1e-2)",
        where, "cluster.account=x", "run.dir=search", cwd=tmp_path,
    )  # fmt: skip
    assert code == 2
    assert f"hydra/sweeper=optuna with {where}: an Optuna search needs each trial's" in err
    assert "sweep a grid of points" in err
    assert not list((tmp_path / "search").rglob("config.yaml"))  # no trial was written
