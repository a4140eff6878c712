"""Rules of the downstream tasks (`eval.tasks`, `eval.tasks_every`, `eval.lm_eval_include`)
and of the stability monitors (`logging.stability_every`, `logging.stability_alerts`): a
task file that cannot be read, an lm-eval task without the package, a threshold of a monitor
that does not exist are refused before any rank starts."""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.core.inputs.reading import ReadError
from pretrain.core.problems import Checks, install_fix, installed
from pretrain.core.schema import STABILITY_ALERTS, RecipeConfig
from pretrain.dataprep.tasks import is_lm_eval, read_task, task_name


def check_tasks(c: Checks, cfg: RecipeConfig, for_launch: bool) -> None:
    """eval.tasks and when they run; with `for_launch` on this machine, the files too."""
    e = cfg.eval
    c.at_least("eval.tasks_every", e.tasks_every, 0)
    if e.tasks and e.tasks_every == 0:
        c.add("eval.tasks_every", 0, f"the {len(e.tasks)} eval.tasks would never be scored",
              "set eval.tasks_every (e.g. 500), or eval.tasks=[]")  # fmt: skip
    if e.tasks_every > 0 and not e.tasks:
        c.add("eval.tasks_every", e.tasks_every, "there are no eval.tasks to score",
              "name task files in eval.tasks, or set eval.tasks_every=0")  # fmt: skip
    if e.tasks and cfg.data.tokenizer == "none":
        c.add("eval.tasks", e.tasks, "tasks are text, and data.tokenizer=none reads none",
              "give the sources' tokenizer in data.tokenizer, or eval.tasks=[]")  # fmt: skip
    names = [task_name(entry) for entry in e.tasks]
    local = for_launch and cfg.cluster.backend == "local"
    for i, entry in enumerate(e.tasks):
        at = f"eval.tasks[{i}]"
        if names[i] in names[:i]:
            first = names.index(names[i])
            c.add(at, entry, f"its metrics name {names[i]!r} is also eval.tasks[{first}]'s",
                  "rename one of the files")  # fmt: skip
        if is_lm_eval(entry):
            if not installed("lm_eval"):
                c.add(at, entry, "the lm-eval package is not installed",
                      f"{install_fix('lm_eval')}, or give a JSONL task file")  # fmt: skip
        elif local:
            try:
                read_task(entry)
            except ReadError as err:
                c.add(at, entry, f"{err.found}; expected {err.expected}", err.fix)
    include = e.lm_eval_include
    if include and local and not Path(os.path.expanduser(include)).is_dir():
        c.add("eval.lm_eval_include", include, "no such directory",
              "give the folder of your lm-eval task YAML files, or ''")  # fmt: skip


def check_stability(c: Checks, cfg: RecipeConfig) -> None:
    """logging.stability_every and the monitors' alert thresholds."""
    g = cfg.logging
    c.at_least("logging.stability_every", g.stability_every, 0)
    for name, threshold in g.stability_alerts.items():
        at = f"logging.stability_alerts.{name}"
        if name not in STABILITY_ALERTS:
            c.add(at, threshold, "no such monitor raises alerts",
                  f"use one of {', '.join(STABILITY_ALERTS)}")  # fmt: skip
        elif not threshold >= 0:
            c.add(at, threshold, "a threshold is a value the monitor may not exceed",
                  "use a positive value, or 0 to turn the alert off")  # fmt: skip
