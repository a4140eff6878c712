"""`pretrain --help`: the recipes, actions, config groups and every field of the schema with
its default, allowed values and doc (generated from the schema's docstrings, never kept by
hand). `pretrain --help SECTION` lists only the fields whose path starts with SECTION."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from pathlib import Path

from pretrain.core.field_docs import field_docs
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.compose.command_line import recipe_names
from pretrain.launcher.compose.recipe_files import group_options

ACTIONS = {
    "run": "plan, write the run dir, then train here (torchrun) or submit (sbatch); default",
    "plan": "print the plan (layout, parameters, memory per rank, step time); write nothing",
    "script": "write the run dir and its job script; launch nothing",
    "suggest": "list the fastest layouts of the model that fit the cluster",
    "prepare": "tokenize the data into a prepared dataset (here, or as a SLURM CPU job)",
    "dryrun": "build one rank and run one step under fake collectives and tensors; vs the plan",
    "calibrate": "measure this hardware's rates on the job's ranks for plan and suggest; time "
    "layouts against the plan",
}
"""What each `action=` does (the schema's `action` field lists the same names)."""

USAGE = """\
pretrain: compose a recipe (Hydra), validate it, plan it, then act.

usage: pretrain [--config-name RECIPE] [--config-dir DIR] [KEY=VALUE | GROUP=OPTION |
                +cluster.env.NAME=VALUE | ~KEY ...] [-m] [--cfg job] [-q | -v]
                [--help [SECTION]]

  -m                 a sweep: KEY=a,b,c gives one run dir per point (runs/RECIPE/POINT);
                     hydra/sweeper=optuna searches KEY=interval(lo,hi) (docs/sweeps.md)
  --cfg job          print the composed recipe and exit
  --config-dir DIR   your own recipes (also PRETRAIN_RECIPES=DIR); see docs/recipes-and-cli.md
  -q, --quiet        warnings and errors only (no plan before a job, no run dir lines)
  -v, --verbose      debug lines too: the overrides, the commands the launcher runs
                     (stdout holds only what was asked for: a JSON plan, the script path)

commands (report, export and dashboard also installed as pretrain-COMMAND):
  pretrain status RUN_DIR...          where a run or a sweep stands
  pretrain diff RUN_A RUN_B           what differs: config, code, packages, plan, curves
  pretrain report RUN_DIR...          the dashboard's panels as a PNG, without W&B
  pretrain export RUN_DIR OUT_DIR     a checkpoint as a Hugging Face folder
  pretrain dashboard --project P      a saved W&B workspace of those panels"""


def _wrap(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, 96, initial_indent=" " * indent, subsequent_indent=" " * indent)


def _listing(rows: Iterable[tuple[str, str]]) -> str:
    """Two columns, indented two blanks (launcher/tables.py: the terminal's width there)."""
    from pretrain.launcher.tables import new_table, render

    table = new_table("name", "what", header=False)
    for name, what in rows:
        table.add_row(name, what)
    return textwrap.indent(render(table), "  ")


def render_help(dirs: list[Path], section: str = "") -> str:
    """The help text for a search path of recipe directories; `section` narrows the fields."""
    lines = [USAGE, ""]
    if not section:
        lines.append("recipes (--config-name RECIPE; default tiny):")
        lines += _wrap(", ".join(recipe_names(dirs)), 2)
        lines += ["", "actions (action=NAME):", _listing(ACTIONS.items())]
        groups = sorted({d.name for directory in dirs for d in directory.iterdir() if d.is_dir()})
        options = [(group, ", ".join(group_options(group, dirs))) for group in groups]
        lines += ["", "config groups (GROUP=OPTION):", _listing(o for o in options if o[1])]
        lines.append("")
    shown = [f for f in field_docs(RecipeConfig) if f.path.startswith(section)]
    if not shown:
        lines.append(f"no field starts with {section!r}; `pretrain --help` lists them all")
        return "\n".join(lines)
    lines.append("fields (KEY=VALUE; after '=' the schema's default, which a recipe may change):")
    for f in shown:
        choices = f"  [{' | '.join(f.choices)}]" if f.choices else ""
        lines.append(f"  {f.path} = {f.default!r}{choices}")
        lines += _wrap(f.doc, 6)
    return "\n".join(lines)
