"""When the downstream tasks run, and their metrics: every `eval.tasks_every` steps and at
the end of the run (not on a stop, which saves instead), each task of `eval.tasks` is scored
through the run's own step and logged as `eval/<task>/<metric>` (acc and acc_norm), and
their mean over the tasks as `eval/average/<metric>` (what the dashboard plots).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer
from torch.distributed.device_mesh import DeviceMesh

from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.tasks import AVERAGE, LM_EVAL_PREFIX, is_lm_eval, read_task, task_name
from pretrain.dataprep.tokenizer import eos_id
from pretrain.trainer.evals.choice_task import ChoiceTaskRunner, Score
from pretrain.trainer.evals.requests import RequestScorer
from pretrain.trainer.step.state import Stepper


class TaskRunner(Protocol):
    """One task: its name and its metrics under the model a scorer reads."""

    name: str

    def run(self, score: Score) -> dict[str, float]: ...


class TaskEvaluator:
    """Runs the tasks when due and names their metrics."""

    def __init__(self, every: int, runners: Sequence[TaskRunner], score: Score) -> None:
        self.every = every if runners else 0
        self.runners = list(runners)
        self.score = score

    def due(self, step: int, last: bool) -> bool:
        """Whether the tasks run after `step`: every `every` steps and the run's last one."""
        return self.every > 0 and (step % self.every == 0 or last)

    def evaluate(self) -> dict[str, float]:
        """{eval/<task>/<metric>: value} of every task, and eval/average/<metric> over the
        tasks that report it (collective)."""
        out: dict[str, float] = {}
        by_metric: dict[str, list[float]] = {}
        for runner in self.runners:
            for metric, value in runner.run(self.score).items():
                out[f"eval/{runner.name}/{metric}"] = value
                by_metric.setdefault(metric, []).append(value)
        for metric, values in by_metric.items():
            out[f"eval/{AVERAGE}/{metric}"] = sum(values) / len(values)
        return out


def task_runners(cfg: RecipeConfig, tokenizer: Tokenizer) -> list[TaskRunner]:
    """The runner of each eval.tasks entry (lm-eval's only where one is named)."""
    runners: list[TaskRunner] = []
    for entry in cfg.eval.tasks:
        if is_lm_eval(entry):
            from pretrain.trainer.evals.lm_eval_adapter import LmEvalRunner

            task = entry.removeprefix(LM_EVAL_PREFIX)
            runners.append(
                LmEvalRunner(task, task_name(entry), cfg.eval.lm_eval_include, tokenizer)
            )
        else:
            runners.append(ChoiceTaskRunner(read_task(entry), tokenizer))
    return runners


def task_evaluator(
    cfg: RecipeConfig,
    tokenizer: Tokenizer | None,
    stepper: Stepper,
    dp_mesh: DeviceMesh,
) -> TaskEvaluator:
    """The run's task evaluator (one that never runs without eval.tasks)."""
    if tokenizer is None or not cfg.eval.tasks or cfg.eval.tasks_every <= 0:
        return TaskEvaluator(0, [], lambda requests: [])
    scorer = RequestScorer(
        stepper,
        eos=eos_id(tokenizer),
        seq_len=cfg.train.seq_len,
        global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dp_mesh.size(),
        dp_group=dp_mesh.get_group(),
    )
    return TaskEvaluator(cfg.eval.tasks_every, task_runners(cfg, tokenizer), scorer.score)
