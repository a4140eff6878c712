"""The built-in runner of a JSONL multiple-choice task (`dataprep/tasks.py`): each choice is
scored as the continuation of the context, by the summed log-likelihood of its tokens (acc)
and by that sum over the choice's length in characters (acc_norm, as lm-eval normalises),
and the example counts as right when its answer scores highest (the first of equal scores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

from pretrain.dataprep.tasks import ChoiceTask
from pretrain.trainer.evals.requests import Request, encode_pair

Score = Callable[[Sequence[Request]], list[tuple[float, bool]]]
"""Scores requests: (log-likelihood, greedy) of each (`RequestScorer.score`)."""


def first_best(values: Sequence[float]) -> int:
    """The index of the largest value (the first of equal ones)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


class ChoiceTaskRunner:
    """Scores one JSONL task's examples; their requests are tokenized once."""

    def __init__(self, task: ChoiceTask, tokenizer: Tokenizer) -> None:
        self.name = task.name
        self.task = task
        self.requests = [
            encode_pair(tokenizer, example.context, choice)
            for example in task.examples
            for choice in example.choices
        ]

    def run(self, score: Score) -> dict[str, float]:
        """{acc, acc_norm} of the task under the model `score` reads."""
        logliks = [loglik for loglik, _ in score(self.requests)]
        right = right_norm = 0
        start = 0
        for example in self.task.examples:
            mine = logliks[start : start + len(example.choices)]
            start += len(example.choices)
            normed = [x / len(c) for x, c in zip(mine, example.choices, strict=True)]
            right += first_best(mine) == example.answer
            right_norm += first_best(normed) == example.answer
        count = len(self.task.examples)
        return {"acc": right / count, "acc_norm": right_norm / count}
