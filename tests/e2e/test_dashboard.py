"""The W&B workspace of `pretrain-dashboard`: built offline with wandb-workspaces, and every
key it plots is one a real run logs (read back from an offline run's .wandb file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.launcher.dashboard import SECTIONS, STEP, workspace
from tests.distributed.harness import BASE_OVERRIDES
from tests.helpers import pairs_corpus_and_task, pretrain, wandb_records

pytestmark = pytest.mark.e2e

PLOTTED = {key for panels in SECTIONS.values() for p in panels for key in p.y}
"""Every W&B key a panel plots."""
FP16_ONLY = {"train/loss_scale"}
"""Logged only by an fp16 run (its loss scaler), which this CPU cannot train."""


def logged_keys(run_dir: Path) -> set[str]:
    """The history and summary keys of the offline W&B run in `run_dir`."""
    [history] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    keys = set()
    for record in wandb_records(history):
        items = record.history.item if record.HasField("history") else record.summary.update
        keys |= {item.key or "/".join(item.nested_key) for item in items}
    return keys


def test_the_workspace_is_built_offline_with_a_section_per_topic() -> None:
    pytest.importorskip("wandb_workspaces", reason="pip install -e '.[dev]'")
    built = workspace("my-team", "pretrain", "pretrain")
    assert [s.name for s in built.sections] == [
        "Throughput", "Loss", "Memory", "MoE", "Downstream", "Stability", "Goodput"
    ]  # fmt: skip
    for section, panels in zip(built.sections, SECTIONS.values(), strict=True):
        assert [p.title for p in section.panels] == [p.title for p in panels]
        for built_panel, panel in zip(section.panels, panels, strict=True):
            if panel.summary:
                assert (built_panel.x.name, built_panel.y.name) == panel.y
            else:
                assert built_panel.x == STEP and list(built_panel.y) == list(panel.y)


def test_the_spec_prints_without_credentials(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["NETRC"] = str(tmp_path / "netrc")
    command = [sys.executable, "-m", "pretrain.launcher.dashboard"]
    printed = subprocess.run([*command, "--print"], capture_output=True, text=True, env=env)
    assert json.loads(printed.stdout).keys() == SECTIONS.keys()
    refused = subprocess.run([*command, "--project", "p"], capture_output=True, text=True,
                             env=env)  # fmt: skip
    assert refused.returncode == 2 and "no W&B credentials" in refused.stderr


def test_the_plan_predictions_the_panels_plot_are_in_a_gpu_recipes_plan(tmp_path: Path) -> None:
    result = pretrain("--config-name", "llama3_8b", "action=plan", "plan.format=json",
                      cwd=tmp_path)  # fmt: skip
    plan = json.loads(result.stdout)
    predicted = {k for k in PLOTTED if k.startswith("plan/")}
    assert predicted and all(plan[k.removeprefix("plan/")] is not None for k in predicted)


@pytest.mark.slow
def test_every_plotted_key_is_logged_by_a_real_moe_run_and_a_spike_raises_a_wandb_alert(
    tmp_path: Path,
) -> None:
    """The run scores a downstream task and samples the stability monitors at every step;
    its second step's loss (and gradients) are made 20 times larger, so the largest layer's
    gradient norm crosses the threshold there, and only there: a warning line and a W&B
    alert."""
    run_dir = tmp_path / "run"
    _, task = pairs_corpus_and_task(tmp_path / "task", pairs=4)
    replaced = ("train.steps", "eval.every", "logging.wandb", "model.ffn_dim", "model.n_layers")
    shrunk = [o for o in BASE_OVERRIDES if not o.startswith(replaced)]
    result = pretrain("--config-name", "tiny_moe", *shrunk, "model.n_layers=2", "train.steps=2",
                      "eval.every=2", "logging.wandb=offline", "parallel.ep=1",
                      f"eval.tasks=[{task}]", "eval.tasks_every=2", "logging.stability_every=1",
                      "logging.stability_alerts.grad_norm_max=5", "cluster.gpus_per_node=1",
                      f"run.dir={run_dir}", cwd=tmp_path, timeout=300,
                      env={"PRETRAIN_FAULT_SPIKE_STEPS": "2"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # On CPU the plan predicts no MFU or tokens/s (no peak): those come from a GPU's plan,
    # checked above.
    cpu_unpredicted = {"plan/mfu", "plan/tokens_per_s"}
    assert PLOTTED - FP16_ONLY - cpu_unpredicted <= logged_keys(run_dir)
    warnings = [line for line in result.stdout.splitlines() if "[stability] warning" in line]
    assert len(warnings) == 1 and "step 2: stability/grad_norm_max" in warnings[0]
    [history] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    alerts = [r.alert for r in wandb_records(history) if r.HasField("alert")]
    assert [a.title for a in alerts] == ["grad_norm_max above 5"]
    assert alerts[0].level == "WARN" and "step 2" in alerts[0].text


def test_creating_the_workspace_online() -> None:
    if not os.environ.get("WANDB_API_KEY"):
        pytest.skip("no WANDB_API_KEY: creating a W&B workspace needs an account online")
    result = subprocess.run([sys.executable, "-m", "pretrain.launcher.dashboard", "--project",
                             os.environ.get("WANDB_PROJECT", "pretrain-dashboard-test")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("http")
