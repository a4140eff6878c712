"""A downstream task in the loop: its accuracy rises as the model learns the corpus it was
built from (one process, a short run through the CLI). Its scores under a parallel layout
against the one-process ones: `tests/distributed/test_pipeline_parity.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import logged_rows, run_pretrain
from tests.helpers import pairs_corpus_and_task


def test_the_task_accuracy_rises_over_a_short_run(tmp_path: Path) -> None:
    corpus, task = pairs_corpus_and_task(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_pretrain(run_dir, [f"data.source={corpus}", "data.val_fraction=0", "eval.every=0",
                           f"eval.tasks=[{task}]", "eval.tasks_every=4", "train.steps=16",
                           "optim.lr=1e-3", "logging.log_every=4"], nproc=1)  # fmt: skip
    rows = logged_rows(run_dir, ("eval/likes/",))
    assert sorted(rows) == [4, 8, 12, 16]
    acc = [rows[step]["eval/likes/acc"] for step in sorted(rows)]
    # 24 questions of 4 choices: about a coin's worth right at first, nearly all at the end.
    assert acc[0] <= 0.7 and acc[-1] >= 0.9, acc
    assert max(acc) == acc[-1], acc


LM_EVAL_TASK = """task: likes_lm_eval
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
"""An lm-eval task over the same examples, read from the local JSONL file (its choices carry
their leading space, so no delimiter is added)."""


def test_an_lm_eval_task_scores_as_the_built_in_runner_under_dp2(tmp_path: Path) -> None:
    """lm-eval's task (through our model adapter) and the built-in runner see the same
    requests and score them alike, under two data-parallel ranks, after one step (when the
    model has learned some of the pairs, not all)."""
    pytest.importorskip("lm_eval", reason="pip install 'pretrain[lm-eval]'")
    corpus, task = pairs_corpus_and_task(tmp_path / "data", pairs=16)
    include = tmp_path / "lm_eval_tasks"
    include.mkdir()
    (include / "likes_lm_eval.yaml").write_text(LM_EVAL_TASK.format(path=task))
    run_dir = tmp_path / "run"
    run_pretrain(run_dir, [f"data.source={corpus}", "data.val_fraction=0", "eval.every=0",
                           f"eval.tasks=[{task},lm_eval:likes_lm_eval]", "eval.tasks_every=1",
                           f"eval.lm_eval_include={include}", "train.steps=1",
                           "optim.lr=3e-4"],
                 nproc=2)  # fmt: skip
    [row] = logged_rows(run_dir, ("eval/",)).values()
    assert 0 < row["eval/likes/acc"] < 1  # some right, some wrong: the equality says much
    for metric in ("acc", "acc_norm"):
        assert row[f"eval/likes_lm_eval/{metric}"] == row[f"eval/likes/{metric}"]
