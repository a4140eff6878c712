"""Downstream tasks: the JSONL format and its refusals, how a choice becomes a scored row,
the log-likelihood and greedy flag of a row against log_softmax by hand, acc and acc_norm,
and the recipe rules of eval.tasks and the stability monitors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.core.inputs.reading import ReadError
from pretrain.dataprep.tasks import ChoiceTask, Example, read_task, task_name
from pretrain.trainer.evals.choice_task import ChoiceTaskRunner
from pretrain.trainer.evals.requests import encode_pair, request_row
from pretrain.trainer.step.scoring import IGNORE, row_scores
from tests.helpers import configure, problems, write_tokenizer


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_task_file_is_read_and_named_by_its_stem(tmp_path: Path) -> None:
    rows = [{"context": "2 + 2 =", "choices": [" 4", " 5"], "answer": 0}, ""]
    task = read_task(str(_write(tmp_path / "arith v1.jsonl", rows)))
    assert task == ChoiceTask("arith_v1", (Example("2 + 2 =", (" 4", " 5"), 0),))
    assert task_name("lm_eval:hellaswag") == "hellaswag"


@pytest.mark.parametrize(
    ("row", "found"),
    [
        ("{not json", "line 1: not JSON"),
        ({"context": 1, "choices": ["a", "b"], "answer": 0}, "no string 'context'"),
        ({"context": "c", "choices": ["a", ""], "answer": 0}, "not a list of non-empty"),
        ({"context": "c", "choices": ["a"], "answer": 0}, "1 choices"),
        ({"context": "c", "choices": ["a", "b"], "answer": 2}, "'answer' is 2"),
        ({"context": "c", "choices": ["a", "b"], "answer": True}, "'answer' is True"),
    ],
)
def test_a_bad_example_is_refused_naming_its_line(tmp_path: Path, row, found: str) -> None:
    with pytest.raises(ReadError, match=found):
        read_task(str(_write(tmp_path / "t.jsonl", [row])))


def test_a_choice_is_the_scored_end_of_its_row(tmp_path: Path) -> None:
    tokenizer_path = write_tokenizer(tmp_path / "tok.json", ["the cat sat on the mat"] * 20, 300)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    context, continuation = encode_pair(tokenizer, "the cat sat ", "on the mat")
    # The context's trailing space moves to the continuation, as lm-eval splits a pair.
    assert tokenizer.decode(context) == "the cat sat"
    assert tokenizer.decode(continuation) == " on the mat"
    inputs, targets = request_row((context, continuation), eos=0, seq_len=12)
    tokens = [0, *context, *continuation]
    n = len(tokens) - 1
    assert inputs[:n].tolist() == tokens[:-1] and (inputs[n:] == 0).all()
    assert targets[n - len(continuation) : n].tolist() == continuation
    assert (targets[: n - len(continuation)] == IGNORE).all() and (targets[n:] == IGNORE).all()
    # Too long: the context is cut from the left, the continuation kept.
    inputs, targets = request_row(([5] * 20, [7, 8]), eos=0, seq_len=4)
    assert inputs.tolist() == [5, 5, 5, 7] and targets.tolist() == [IGNORE] * 2 + [7, 8]


def test_row_scores_sum_the_log_probabilities_of_the_scored_targets() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.full((2, 5), IGNORE)
    targets[0, 2:] = torch.tensor([3, 4, 5])
    targets[1, 4] = logits[1, 4].argmax()  # the most likely token: greedy
    logp = logits.log_softmax(-1)
    expected = [logp[0, 2, 3] + logp[0, 3, 4] + logp[0, 4, 5], logp[1, 4].max()]
    scores = row_scores(logits, targets)
    assert scores[:, 0].tolist() == pytest.approx([e.item() for e in expected], rel=1e-6)
    assert scores[1, 1] == 0 and scores[0, 1] > 0
    # With the head applied in chunks (train.loss_chunks), the same scores.
    head = torch.nn.Linear(7, 11, bias=False)
    hidden = torch.randn(2, 6, 7)
    whole = row_scores(head(hidden), torch.full((2, 6), 2))
    torch.testing.assert_close(row_scores(hidden, torch.full((2, 6), 2), head, chunks=3), whole)


def test_acc_takes_the_summed_log_likelihood_and_acc_norm_the_one_per_character() -> None:
    task = ChoiceTask("t", (Example("q", (" a", " bbbb"), 1), Example("q", (" a", " b"), 0)))

    class Whitespace:
        def encode(self, text: str):
            return type("E", (), {"ids": [ord(c) for c in text]})()

    runner = ChoiceTaskRunner(task, Whitespace())  # type: ignore[arg-type]
    # Example 1: " a" -1.0 beats " bbbb" -1.5, but per character (-0.5 vs -0.3) " bbbb" wins.
    scores = {0: -1.0, 1: -1.5, 2: -2.0, 3: -3.0}
    result = runner.run(lambda requests: [(scores[i], False) for i in range(len(requests))])
    assert result == {"acc": 0.5, "acc_norm": 1.0}


def test_tasks_and_monitors_are_refused_before_a_launch(tmp_path: Path) -> None:
    task = _write(tmp_path / "t.jsonl", [{"context": "c", "choices": ["a", "b"], "answer": 0}])
    cases = {
        "eval.tasks_every": {"eval.tasks": [str(task)], "eval.tasks_every": 0},
        "eval.tasks[1]": {"eval.tasks": [str(task), str(task)], "eval.tasks_every": 5},
        "eval.tasks[0]": {"eval.tasks": [str(tmp_path / "none.jsonl")], "eval.tasks_every": 5},
        "logging.stability_alerts.spikes": {"logging.stability_alerts": {"spikes": 1.0}},
        "logging.stability_alerts.z_mean": {"logging.stability_alerts": {"z_mean": -1.0}},
        "logging.stability_every": {"logging.stability_every": -1},
    }
    for field, overrides in cases.items():
        found = [p for p in problems(configure(overrides), for_launch=True) if p.field == field]
        assert found, field
    # A readable task that runs raises nothing (the steps' problem is there to be raised).
    ok = {"eval.tasks": [str(task)], "eval.tasks_every": 5, "train.steps": 0}
    found = problems(configure(ok), for_launch=True)
    assert [p.field for p in found if "eval." in p.field or "logging." in p.field] == []
