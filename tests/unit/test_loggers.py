"""Metrics sinks: metrics.jsonl, the console line and a real (offline) Weights & Biases run."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from pretrain.core.layout import resolve_degrees
from pretrain.core.run.durations import format_duration
from pretrain.core.run.metric_names import flat_name
from pretrain.core.schema import LoggingConfig, RecipeConfig
from pretrain.trainer.observe.loggers import (
    WANDB_ID_FILE,
    MetricsLogger,
    console_line,
    node_wandb_dir,
    resolve_wandb_mode,
    truncate_partial_line,
    wandb_key,
)
from pretrain.trainer.observe.run_identity import RunIdentity, run_identity
from tests.helpers import finished_wandb_records

METRICS = {
    "loss": 3.25,
    "lr": 3e-4,
    "grad_norm": 0.75,
    "tokens_per_s": 12000.0,
    "tflops_per_device": 0.5,
    "mfu": 0.25,
    "hfu": None,
}


@pytest.fixture(autouse=True)
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep W&B's caches and credentials lookups inside the test's tmp dir."""
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


IDENTITY = RunIdentity("tiny lr=0.01", "tiny:optim.lr", "train", ["tiny", "tp1-pp1-dp2-zero0"],
                       {"mfu": 0.41, "memory_gib": 3.5})  # fmt: skip


def make_logger(
    run_dir: Path, *, wandb: str = "disabled", is_main: bool = True, tensorboard: bool = False
) -> MetricsLogger:
    return MetricsLogger(
        run_dir,
        is_main=is_main,
        logging=LoggingConfig(wandb=wandb, tensorboard=tensorboard),
        config={"model": {"dim": 128}},
        identity=IDENTITY,
        total_steps=10,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_log_call_appends_one_json_line_with_step_and_every_metric(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(1, METRICS)
        logger.log(2, {**METRICS, "loss": 3.0})
        # Flushed per line: readable while the logger is still open.
        assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["loss"] for r in records] == [3.25, 3.0]
    for record in records:
        assert set(record) == {"step", "time", *METRICS}
        assert record["hfu"] is None


def test_a_second_logger_appends_after_the_first(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(1, METRICS)
    with make_logger(tmp_path) as logger:
        logger.log(2, METRICS)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_partial_last_line_from_a_crash_is_cut_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.5}\n{"step": 2, "loss": 3.4}\n{"step": 3, "lo')
    with make_logger(tmp_path) as logger:
        logger.log(3, METRICS)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


def test_truncation_keeps_complete_files_and_finds_newlines_far_back(tmp_path: Path) -> None:
    complete = tmp_path / "complete.jsonl"
    complete.write_text('{"step": 1}\n{"step": 2}\n')
    truncate_partial_line(complete)
    assert complete.read_text() == '{"step": 1}\n{"step": 2}\n'

    long_tail = tmp_path / "long.jsonl"
    long_tail.write_text('{"step": 1}\n' + "x" * 200_000)
    truncate_partial_line(long_tail)
    assert long_tail.read_text() == '{"step": 1}\n'

    only_partial = tmp_path / "partial.jsonl"
    only_partial.write_text('{"step": 1, "lo')
    truncate_partial_line(only_partial)
    assert only_partial.read_text() == ""


def test_non_main_rank_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with make_logger(run_dir, wandb="offline", is_main=False) as logger:
        logger.log(1, METRICS)
    assert not run_dir.exists()


def test_console_line_shows_progress_and_mfu_as_a_percentage() -> None:
    line = console_line(5, 10, METRICS)
    assert line.startswith("step 5/10 | loss 3.2500 | lr 3.00e-04 | grad norm 0.750")
    assert f"{METRICS['tokens_per_s']:,.0f} tok/s" in line
    assert f"MFU {100 * METRICS['mfu']:.1f}%" in line
    assert console_line(5, 10, {**METRICS, "mfu": None}).endswith("MFU n/a")


def test_console_line_shows_task_accuracy_and_the_sampled_monitors() -> None:
    sampled = {**METRICS, "eval/arc/acc": 0.5, "eval/arc/acc_norm": 0.0,
               "stability/attn_logit_max": 12.5, "stability/z_mean": 40.25}  # fmt: skip
    line = console_line(5, 10, sampled)
    assert "arc acc 0.500 (norm 0.000)" in line
    assert line.endswith("max attn logit 12.5, z-mean 40.2")
    # Their W&B keys are their names, and pretrain-report reads them back.
    assert wandb_key("eval/arc/acc") == "eval/arc/acc" and flat_name("stability/z_mean") == (
        "stability/z_mean"
    )


def test_wandb_keys_come_from_one_table_and_unknown_names_go_under_train() -> None:
    assert [wandb_key(k) for k in ("loss", "mfu", "mem_peak_gib", "aux_loss")] == [
        "train/loss",
        "perf/mfu",
        "mem/peak_gib",
        "train/aux_loss",
    ]


def test_auto_mode_is_online_only_with_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert resolve_wandb_mode("auto") == "online"
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled"
    assert resolve_wandb_mode("offline") == "offline"
    with pytest.raises(ValueError, match="auto, online, offline, disabled"):
        resolve_wandb_mode("yes")


def sync_dirs(output: str) -> set[Path]:
    """Directories named in the `wandb sync DIR` hints of the console output."""
    return {Path(m) for m in re.findall(r"wandb sync (\S+)", output)}


def test_offline_wandb_run_is_written_in_the_run_dir_and_resumes_the_same_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with make_logger(tmp_path, wandb="offline") as logger:
        logger.log(1, METRICS)
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    (first,) = sync_dirs(capsys.readouterr().out)
    assert first.parent == tmp_path / "wandb"
    assert (first / f"run-{run_id}.wandb").is_file()

    with make_logger(tmp_path, wandb="offline") as logger:
        logger.log(2, METRICS)
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id
    (second,) = sync_dirs(capsys.readouterr().out)
    assert second != first
    assert (second / f"run-{run_id}.wandb").is_file()


def test_wandb_that_cannot_start_warns_and_the_other_sinks_keep_working(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Online without any API key: wandb.init refuses at once.
    with make_logger(tmp_path, wandb="online") as logger:
        logger.log(1, METRICS)
    assert "W&B disabled" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


def test_validation_and_mixture_metrics_reach_every_sink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = {**METRICS, "val_loss": 2.5, "val_ppl": 12.18, "tokens_seen_code": 4096}
    with make_logger(tmp_path, wandb="offline") as logger:
        logger.log(4, metrics)
    assert "| val loss 2.5000 (ppl 12.18) |" in capsys.readouterr().out
    [row] = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["val_loss"] == 2.5 and row["val_ppl"] == 12.18 and row["tokens_seen_code"] == 4096
    assert [wandb_key(k) for k in ("val_loss", "val_ppl", "tokens_seen_code")] == [
        "val/loss",
        "val/ppl",
        "data/tokens_seen_code",
    ]
    [history] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file; on a loaded machine it may still be flushing
    # when finish() returns.
    deadline = time.monotonic() + 60
    while b"data/tokens_seen_code" not in history.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    recorded = history.read_bytes()
    assert b"val/loss" in recorded and b"data/tokens_seen_code" in recorded


def test_the_wandb_run_has_its_name_group_job_type_tags_and_the_plans_predictions(
    tmp_path: Path,
) -> None:
    with make_logger(tmp_path, wandb="offline") as logger:
        logger.log(1, METRICS)
    [history] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = finished_wandb_records(history)
    [run] = [r.run for r in records if r.HasField("run")][:1]
    assert (run.display_name, run.run_group, run.job_type) == (
        "tiny lr=0.01",
        "tiny:optim.lr",
        "train",
    )
    assert list(run.tags) == ["tiny", "tp1-pp1-dp2-zero0"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["plan"] == {"mfu": 0.41, "memory_gib": 3.5}
    summary = {
        item.key: json.loads(item.value_json)
        for r in records if r.HasField("summary") for item in r.summary.update
    }  # fmt: skip
    assert summary["plan/mfu"] == 0.41 and summary["plan/memory_gib"] == 3.5


def test_tensorboard_events_hold_the_same_scalars_as_metrics_jsonl(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    with make_logger(tmp_path, tensorboard=True) as logger:
        logger.log(1, METRICS)
        logger.log(2, {**METRICS, "loss": 3.0})
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(1, pytest.approx(METRICS["loss"])), (2, 3.0)]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    numeric = {
        k for k, v in rows[0].items() if isinstance(v, (int, float)) and k not in ("step", "time")
    }
    assert {wandb_key(k) for k in numeric} <= set(events.Tags()["scalars"])


def test_the_step_line_ends_with_the_time_left_at_the_current_step_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(4, {**METRICS, "step_time_s": 125.0})
        logger.log(10, {**METRICS, "step_time_s": 125.0})
    first, last = capsys.readouterr().out.splitlines()[-2:]
    assert first.endswith(" | ETA 12m30s")  # 6 steps of 125 s
    assert "ETA" not in last
    assert [format_duration(s) for s in (0.42, 7, 12.4, 247, 7500, 270000)] == [
        "0.4s", "7.0s", "12.4s", "4m07s", "2h05m", "3d03h"
    ]  # fmt: skip


def test_another_nodes_first_rank_records_its_system_metrics_in_a_run_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node_logger = MetricsLogger(
        tmp_path, is_main=False, logging=LoggingConfig(wandb="offline"), config={},
        identity=IDENTITY, total_steps=10, node=1,
    )  # fmt: skip
    with node_logger:
        node_logger.log(1, METRICS)  # the main run's to log
    run_id = (node_wandb_dir(tmp_path, 1) / "run_id").read_text().strip()
    [history] = (node_wandb_dir(tmp_path, 1) / "wandb").glob(f"offline-run-*-{run_id}/*.wandb")
    records = finished_wandb_records(history)
    [run] = [r.run for r in records if r.HasField("run")][:1]
    assert (run.display_name, run.run_group, run.job_type) == (
        "tiny lr=0.01-node1",
        "tiny:optim.lr",
        "node-system",
    )
    keys = {item.key for r in records if r.HasField("stats") for item in r.stats.item}
    # W&B samples once at the start, then every 15 s (WANDB__STATS_SAMPLING_INTERVAL).
    assert {"memory_percent/l:node1", "proc.memory.rssMB/l:node1"} <= keys
    assert all(key.endswith("/l:node1") for key in keys)
    assert not any(r.HasField("history") for r in records)  # no training metric
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / WANDB_ID_FILE).exists()
    assert f"wandb sync {history.parent}" in capsys.readouterr().out


def test_a_run_on_several_nodes_is_grouped_under_its_run_dir_unless_a_group_is_set(
    tmp_path: Path,
) -> None:
    cfg = RecipeConfig()
    run_dir = tmp_path / "llama-2node"

    def group(nodes: int, wandb_group: str = "") -> str | None:
        cfg.cluster.nodes, cfg.logging.wandb_group = nodes, wandb_group
        return run_identity(cfg, run_dir, resolve_degrees(cfg)).group

    assert group(1) is None
    assert group(2) == "llama-2node"  # where the other nodes' system-metrics runs sit too
    assert group(2, "sweep:optim.lr") == "sweep:optim.lr"


def test_the_time_left_follows_the_median_step_time_so_one_slow_step_barely_moves_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with make_logger(tmp_path) as logger:
        for step, seconds in [(1, 10.0), (2, 10.0), (3, 50.0)]:
            logger.log(step, {**METRICS, "step_time_s": seconds})
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(" | ETA 1m10s")  # 7 steps at the median 10 s, not at 50 s


def test_the_summary_covers_the_whole_run_with_the_jobs_before_a_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with make_logger(tmp_path) as first_job:
        first_job.log(4, {**METRICS, "loss": 3.0, "val_loss": 2.5, "val_ppl": 12.2})
        first_job.log(5, {**METRICS, "loss": 2.9, "val_loss": 2.7, "val_ppl": 14.9})
    with (tmp_path / "metrics.jsonl").open("a") as rows:
        rows.write('{"step": null}\n[1, 2]\n{"step": 1e400, "val_loss": 0.1}\n')
    with make_logger(tmp_path) as resumed:
        resumed.log(10, {**METRICS, "loss": 2.4, "val_loss": 2.6, "val_ppl": 13.5})
        resumed.print_summary(tokens=40_960, wall_s=75, checkpoint=tmp_path / "ckpt")
    out = capsys.readouterr().out
    block = out[out.index("run finished") :].splitlines()
    assert block[0] == "run finished: 10 steps, 40,960 tokens, this job 1m15s"
    assert block[1] == "  train loss 2.4000 | val loss 2.6000 (best 2.5000 at step 4)"
    assert block[2] == f"  checkpoint: {tmp_path / 'ckpt'}"
    assert block[-1] == f"  export:  pretrain export {tmp_path} {tmp_path}-hf"


def test_a_run_without_a_checkpoint_or_validation_says_so_and_offers_no_export(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(10, {**METRICS, "val_loss": None})
        logger.print_summary(tokens=0, wall_s=3, checkpoint=None)
    block = capsys.readouterr().out.split("run finished")[1]
    assert "val loss n/a (best n/a)" in block
    assert "checkpoint: none written" in block
    assert "pretrain export" not in block


def test_a_fault_action_is_a_console_line_and_a_point_in_wandb_and_tensorboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    record = {"step": 6, "trigger": "spike", "action": "rollback", "detail": "loss 9 > 3 x 2",
              "to": 4, "skipped_batches": [5, 6], "lr_factor": 0.5, "lr_until": 7}  # fmt: skip
    with make_logger(tmp_path, wandb="offline", tensorboard=True) as logger:
        logger.log(6, METRICS)
        logger.event(record)
    line = "[faults] step 6: loss 9 > 3 x 2: rollback to the checkpoint of step 4, batches 5..6 "
    assert line + "skipped, lr x0.5 until step 7" in capsys.readouterr().out
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("faults/spike_rollback")] == [(6, 1.0)]
    [history] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while b"faults/spike_rollback" not in history.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"faults/spike_rollback" in history.read_bytes()
