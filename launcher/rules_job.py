"""Rules of the job script's extension fields: the Python that runs torchrun on each node
(and, below, the user's template, extra #SBATCH lines, setup lines and container).

Each value reaches the rendered script quoted (see launcher/job.py); these rules refuse what
quoting cannot make right: line breaks in a one-line value, paths that mean something else
on the node than here.
"""

from __future__ import annotations

import re

from pretrain_core.problems import Checks
from pretrain_core.schema import RecipeConfig

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_job(c: Checks, cfg: RecipeConfig) -> None:
    """cluster.python and the job script's other extension points."""
    python = cfg.cluster.python
    if python and _CONTROL.search(python):
        c.add("cluster.python", python, "holds a line break or control character",
              "give one command name or an absolute path")  # fmt: skip
    elif "/" in python and not python.startswith("/"):
        c.add("cluster.python", python,
              "a relative path would be looked up from wherever the job starts on the node",
              "give an absolute path, e.g. /opt/venv/bin/python, or a name on PATH such as "
              "python3")  # fmt: skip
