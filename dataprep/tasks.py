"""Downstream multiple-choice tasks in local JSONL files (`eval.tasks`).

One example per line: `{"context": "...", "choices": ["...", "..."], "answer": 1}`, the
answer being the index of the right choice. A choice is scored as the continuation of the
context (`context + choice` is the text the model reads), so a choice usually starts with
the space or newline that separates it from the context. The task is named by the file's
stem. Entries of the form `lm_eval:TASK` name a task of the lm-eval harness instead
(`trainer/evals/lm_eval_adapter.py`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.inputs.reading import ReadError, read_text

LM_EVAL_PREFIX = "lm_eval:"
"""An eval.tasks entry that names an lm-eval task rather than a JSONL file."""
AVERAGE = "average"
"""The name of the tasks' mean in the metrics (eval/average/acc): no task may take it."""
MAX_TASK_BYTES = 256 << 20
"""Largest task file read (a downstream task is thousands of examples, not a corpus)."""
MAX_CHOICES = 64
"""Most choices of one example (every choice is a sequence to score)."""
_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
EXPECTED = 'a JSONL task: one {"context": str, "choices": [str, ...], "answer": int} per line'


@dataclass(frozen=True)
class Example:
    """One multiple-choice question: the text before the choices and the right choice."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class ChoiceTask:
    """A named list of multiple-choice examples."""

    name: str
    examples: tuple[Example, ...]


def is_lm_eval(entry: str) -> bool:
    """Whether an eval.tasks entry names an lm-eval task."""
    return entry.startswith(LM_EVAL_PREFIX)


def task_name(entry: str) -> str:
    """The metrics name of an eval.tasks entry (eval/<name>/acc): an lm-eval task's name,
    or the JSONL file's stem, in letters, digits, '_', '.' and '-'."""
    raw = entry.removeprefix(LM_EVAL_PREFIX) if is_lm_eval(entry) else Path(entry).stem
    return _NAME.sub("_", raw).strip("_") or "task"


def read_task(entry: str) -> ChoiceTask:
    """The examples of a JSONL task file; ReadError naming the first bad line."""
    path = Path(os.path.expanduser(entry))
    text = read_text(path, EXPECTED, MAX_TASK_BYTES)
    examples = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            examples.append(_example(path, number, line))
    if not examples:
        raise ReadError(path, "no examples", EXPECTED, "write one example per line")
    return ChoiceTask(task_name(entry), tuple(examples))


def _example(path: Path, number: int, line: str) -> Example:
    """The example of line `number`, or ReadError saying what is wrong with it."""

    def bad(found: str) -> ReadError:
        return ReadError(path, f"line {number}: {found}", EXPECTED, "fix or remove that line")

    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(row, dict):
        raise bad("not a JSON object")
    context, choices, answer = row.get("context"), row.get("choices"), row.get("answer")
    if not isinstance(context, str):
        raise bad("no string 'context'")
    if not (isinstance(choices, list) and all(isinstance(c, str) and c for c in choices)):
        raise bad("'choices' is not a list of non-empty strings")
    if not 2 <= len(choices) <= MAX_CHOICES:
        raise bad(f"{len(choices)} choices; an example has 2 to {MAX_CHOICES}")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise bad(f"'answer' is {answer!r}, not the index of one of its {len(choices)} choices")
    return Example(context, tuple(choices), answer)
