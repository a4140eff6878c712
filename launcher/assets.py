"""Where the shipped recipes and sbatch templates are: `recipes/` and `slurm/` beside the
`launcher` package this module was imported from, which is the checkout's top level (or its
`pretrain/` links) in a source tree and the `pretrain` package folder in an installed wheel
(pyproject.toml maps both directories into it).

The files beside the running code win, so a worktree run with PYTHONPATH reads its own
recipes, not those of another install on the same Python.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def shipped_dir(name: str) -> Path:
    """The directory of shipped files `name` ("recipes" or "slurm")."""
    found = _PACKAGE_ROOT / name
    if not found.is_dir():
        raise FileNotFoundError(
            f"the shipped {name} are missing: {found} does not exist; reinstall pretrain"
        )
    return found


SHIPPED_RECIPES = shipped_dir("recipes")
"""The recipes that come with pretrain (the first directory of Hydra's search path)."""
SBATCH_TEMPLATE = shipped_dir("slurm") / "sbatch.template"
"""The training job's sbatch template (`cluster.sbatch_template` replaces it)."""
PREPARE_TEMPLATE = shipped_dir("slurm") / "prepare.sbatch.template"
"""The data preparation job's sbatch template."""


class ScriptTemplate(Template):
    """`${name}` placeholders are lowercase; `$UPPERCASE` and `$(...)` are left to the shell."""

    idpattern = r"[a-z][a-z0-9_]*"
    flags = re.RegexFlag(0)


def template_placeholders(text: str) -> set[str]:
    """The ${placeholders} an sbatch template holds."""
    template = ScriptTemplate(text)
    found = {m["named"] or m["braced"] for m in template.pattern.finditer(template.template)}
    return found - {None}
