"""Long waits show their progress: what is waited for (a lock's holder, a checkpoint's step
and size), the time so far, the fraction and ETA where known, and a final line with the
duration; plain lines every PRETRAIN_PROGRESS_EVERY_S seconds, a redrawn one on a terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.dataprep.cache_lock import note_path
from pretrain.dataprep.prepare import dataset_lock
from pretrain.dataprep.progress import PLAIN_EVERY_ENV
from pretrain.dataprep.sources import dataset_places
from pretrain.dataprep.waiting import Wait
from pretrain.trainer.data.loader import open_datasets
from tests.helpers import data_recipe, generated_documents, write_jsonl, write_tokenizer

ELAPSED = r"[\d.]+s elapsed"
ETA = r"ETA [\d.]+s"


@pytest.fixture
def quick_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLAIN_EVERY_ENV, "0.2")


def test_a_wait_writes_a_plain_line_at_each_interval_then_its_duration(quick_lines) -> None:
    lines: list[str] = []
    done = iter([0.2, 0.4, 0.6, 0.8] + [0.9] * 100)
    with Wait(
        "x: waiting for y", lines.append, detail=lambda: "held by z", fraction=lambda: next(done)
    ):
        time.sleep(0.9)
    *progress, final = lines
    assert len(progress) >= 4  # one at once, then about one per 0.2 s
    assert progress[0] == "x: waiting for y (held by z): 20%, 0.0s elapsed"
    assert re.fullmatch(rf"x: waiting for y \(held by z\): 40%, {ETA}, {ELAPSED}", progress[1])
    assert re.fullmatch(r"x: waiting for y: done in (0\.9|1\.\d)s", final)


def test_a_load_can_name_its_outcome_and_a_failed_one_says_it_stopped(quick_lines) -> None:
    lines: list[str] = []
    with Wait("checkpoint: loading step 4 (1.2MB)", lines.append, announce=False) as wait:
        wait.outcome = "checkpoint: loaded step 4 (1.2MB)"
    assert lines == ["checkpoint: loaded step 4 (1.2MB) in 0.0s"]
    lines.clear()
    with pytest.raises(KeyError), Wait("data: waiting", lines.append, announce=False):
        raise KeyError("gone")
    assert lines == ["data: waiting: stopped after 0.0s (KeyError)"]


def test_on_a_terminal_the_line_is_redrawn_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    with Wait("data: waiting", tty=True):
        time.sleep(0.1)
    out = capsys.readouterr().out
    assert out.startswith("\rdata: waiting: 0.0s elapsed\x1b[K")
    assert re.search(r"\rdata: waiting: done in 0\.\ds\x1b\[K\n$", out)


HOLDER = """
import sys, time
from tests.helpers import data_recipe
from pretrain.dataprep.cache_lock import held
from pretrain.dataprep.prepare import dataset_lock, prepare_data
from pretrain.dataprep.sources import dataset_places
source, cache, tokenizer = sys.argv[1:4]
cfg = data_recipe(source, cache, tokenizer)
[place] = dataset_places(cfg.data, cfg.model.vocab_size)
with held(dataset_lock(place), "holder") as holding:
    holding.publish(0.25, "prepare corpus: 25%")
    print("held", flush=True)
    time.sleep(1.0)
    holding.publish(0.5, "prepare corpus: 50%")
    time.sleep(1.0)
if sys.argv[4] == "prepare":
    prepare_data(cfg, report=lambda _: None)
"""


def hold_the_dataset_lock(tmp_path: Path, then: str) -> tuple[subprocess.Popen, object]:
    """Another process holding the lock of the dataset's preparation for 2 s (publishing
    25%, then 50%), then preparing it (`then="prepare"`) or not; and the run's recipe."""
    docs = generated_documents(40)
    corpus = write_jsonl(tmp_path / "corpus" / "docs.jsonl", docs)
    tokenizer = write_tokenizer(tmp_path / "tok" / "tokenizer.json", docs)
    args = [str(corpus.parent), str(tmp_path / "cache"), str(tokenizer)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args, then], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child, data_recipe(*args)


def test_the_main_rank_waits_for_another_preparation_naming_its_holder(
    tmp_path: Path, quick_lines
) -> None:
    child, cfg = hold_the_dataset_lock(tmp_path, then="stop")
    lines: list[str] = []
    [dataset] = open_datasets(cfg, is_main=True, report=lines.append)
    assert child.wait(timeout=30) == 0
    *waits, final = [line for line in lines if line.startswith("data: waiting for the prep")]
    assert len(waits) >= 5  # at once, then every 0.2 s of the 2 s
    assert f"(held by pid {child.pid} on host " in waits[0]
    assert waits[0].endswith("; prepare corpus: 25%): 25%, 0.0s elapsed")
    assert any(re.search(rf"; prepare corpus: 50%\): 50%, {ETA}, {ELAPSED}$", w) for w in waits)
    assert re.search(r": done in [12]\.\ds$", final)
    # The lock came free with no dataset: this process prepared it, with its own progress.
    assert any(line.startswith("prepare ") for line in lines) and dataset.manifest["documents"]


def test_other_ranks_wait_for_the_main_ranks_preparation_showing_its_progress(
    tmp_path: Path, quick_lines
) -> None:
    child, cfg = hold_the_dataset_lock(tmp_path, then="prepare")
    lines: list[str] = []
    [dataset] = open_datasets(cfg, is_main=False, report=lines.append)
    assert child.wait(timeout=30) == 0
    *waits, final = lines
    assert waits[0].startswith("data: waiting for the preparation of ")
    assert f"(by the main rank) (held by pid {child.pid} on host " in waits[0]
    assert "; prepare corpus: 25%): 25%, 0.0s elapsed" in waits[0]
    assert any("; prepare corpus: 50%): 50%, ETA " in line for line in waits)
    assert re.fullmatch(r"data: waiting for the preparation of .*: done in \d+\.\ds", final)
    assert dataset.manifest["documents"] == 40
    [place] = dataset_places(cfg.data, cfg.model.vocab_size)
    assert not note_path(dataset_lock(place)).exists()  # removed with the lock
