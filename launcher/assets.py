"""Where the shipped recipes and sbatch templates are: the source tree's `recipes/` and
`slurm/` when the launcher runs from a checkout (editable install, PYTHONPATH), else the
same files installed beside the code as the packages `pretrain_recipes` and
`pretrain_slurm` (pyproject.toml maps the two directories to them in the wheel).

The checkout wins so that a worktree run with PYTHONPATH reads its own recipes, not those of
another editable install on the same Python.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from string import Template

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"recipes": "pretrain_recipes", "slurm": "pretrain_slurm"}


def shipped_dir(name: str) -> Path:
    """The directory of shipped files `name` ("recipes" or "slurm")."""
    in_checkout = _SOURCE_ROOT / name
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and in_checkout.is_dir():
        return in_checkout
    spec = importlib.util.find_spec(_PACKAGES[name])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the shipped {name} are missing: neither {in_checkout} nor the package "
            f"{_PACKAGES[name]} exists; reinstall pretrain"
        )
    return Path(next(iter(spec.submodule_search_locations)))


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
