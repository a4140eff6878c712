"""lm-eval (EleutherAI's evaluation harness, the `lm-eval` extra) as a task runner: its task
builds the requests and computes the metrics, and our model adapter (`PretrainLM`, its
`LM` interface) scores the log-likelihoods through the run's own step.

Every rank runs the same lm-eval evaluation (the same requests, in the same order: its
seeds are fixed), so the adapter's collective scoring meets on every rank. The data must be
local: the Hugging Face hub is set offline for it, and a task of one's own is a YAML file in
`eval.lm_eval_include` whose dataset points at local files (`dataset_path: json` with
`dataset_kwargs.data_files`). Log-likelihood tasks only (multiple choice, a target's
likelihood): generation and rolling perplexity are refused by lm-eval's request to them.
Imported only where an `lm_eval:` task is named, so the default install never needs it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.task import Task
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager, get_task_dict
from tokenizers import Tokenizer

from pretrain.trainer.evals.choice_task import Score
from pretrain.trainer.evals.requests import encode_pair

FEWSHOT_SEED = 1234
"""The seed of a few-shot task's examples (lm-eval's own default)."""


class PretrainLM(LM):
    """The model under training, as lm-eval sees it: log-likelihoods only."""

    def __init__(self, tokenizer: Tokenizer, score: Score) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.score = score

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each request's continuation given its context."""
        pairs = [encode_pair(self.tokenizer, *request.args) for request in requests]
        return self.score(pairs)

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("eval.tasks runs multiple-choice (log-likelihood) tasks only")

    def generate_until(self, requests: list[Any]) -> list[str]:
        raise NotImplementedError("eval.tasks runs multiple-choice (log-likelihood) tasks only")


class LmEvalRunner:
    """One lm-eval task, run in full at each evaluation."""

    def __init__(self, task: str, name: str, include: str, tokenizer: Tokenizer) -> None:
        self.task, self.name = task, name
        self.include = os.path.expanduser(include) if include else None
        self.tokenizer = tokenizer

    def run(self, score: Score) -> dict[str, float]:
        """The task's metrics (acc, acc_norm, ... without their standard errors)."""
        # Local data only: a task that would download fails instead of fetching.
        os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        tasks = get_task_dict([self.task], TaskManager(include_path=self.include))
        for task in tasks.values():
            if isinstance(task, Task):  # as lm-eval's simple_evaluate sets them up
                if task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
        # `evaluate`, not `simple_evaluate`: that one returns its results on the process of
        # local rank 0 only, and reseeds torch's generator, which training owns.
        results = evaluate(
            lm=PretrainLM(self.tokenizer, score),
            task_dict=tasks,
            log_samples=False,
            bootstrap_iters=0,
            verbosity="WARNING",
        )
        assert results is not None  # our adapter is lm-eval's rank 0 on every rank
        metrics = results["results"][self.task]
        return {
            key.partition(",")[0]: float(value)
            for key, value in metrics.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))
        }
