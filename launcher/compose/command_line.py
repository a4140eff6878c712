"""The command line and the recipe files, checked before Hydra composes; Hydra's own errors
turned into the validator's `field=value: reason; fix` list.

Hydra stops at the first problem, silently drops a `+key` the schema lacks, lists its search
path for a mistyped recipe and lets `hydra.*` settings run code. So, before it runs:

- every argument is bounded (length, nesting) and UTF-8;
- every YAML file on the search path is read defensively (`launcher/compose/recipe_files.py`);
- every override is parsed on its own and checked: Hydra settings refused, keys against the
  schema (with a did-you-mean), values against the field's type, group options and the
  recipe name against what exists;

and everything found is raised as one RecipeError. What Hydra still raises while composing
is translated by `hydra_errors_as_problems`.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import env_value
from pretrain.core.problems import Problem, RecipeError, or_list
from pretrain.launcher.assets import SHIPPED_RECIPES
from pretrain.launcher.compose.recipe_files import (
    HYDRA_SETTINGS_FILE,
    MAX_FILES,
    check,
    content_problems,
    defaults_problems,
    file_problem,
    group_options,
    has_package_header,
    hydra_problem,
    is_hydra_key,
    load,
    package_of,
    read_text,
    unknown_option,
    yaml_files,
)
from pretrain.launcher.compose.recipe_keys import (
    key_exists,
    leaf_types,
    sections,
    unknown_key,
    value_problem,
)
from pretrain.launcher.compose.sweep_settings import (
    is_sweeper_setting,
    points_problem,
    sweeper_problems,
    values_count,
)

RECIPES_ENV = "PRETRAIN_RECIPES"
"""A directory of the user's own recipes, searched like --config-dir (which wins if given)."""
MAX_ARG_CHARS = 10_000
"""Longest command-line argument accepted (a list of a few hundred numbers fits)."""
MAX_ARG_DEPTH = 32
"""Deepest nesting of brackets in one argument."""
QUIET_HYDRA = (
    "hydra.output_subdir=null",
    "hydra.run.dir=.",
    "hydra.job.chdir=false",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
)
"""Hydra settings the launcher always adds: Hydra itself writes nothing (no outputs/, no
.hydra/, no log files), whatever recipe is composed."""


def _search_path(args: Any) -> tuple[list[Path], list[Path], list[Problem]]:
    """(every config dir, the user's own dirs, problems) from --config-path/--config-dir."""
    dirs, user, problems = [], [], []
    for flag, raw in (("--config-path", args.config_path), ("--config-dir", args.config_dir)):
        if raw is None:
            continue
        if "://" in raw and not raw.startswith("file://"):
            reason = "only a directory of YAML files can hold recipes here"
            problems.append(Problem(flag, raw, reason, "give a directory path"))
            continue
        path = Path(raw.removeprefix("file://")).expanduser()
        # Hydra reads a relative --config-path from the directory of launcher/cli.py.
        if flag == "--config-path" and not path.is_absolute():
            path = Path(__file__).resolve().parents[1] / path
        if not path.is_dir():
            problems.append(Problem(flag, raw, "no such directory", "give a directory of recipes"))
            continue
        user.append(path.resolve())
    if args.config_path is None:
        dirs.append(SHIPPED_RECIPES)
    return dirs + user, user, problems


def search_dirs(argv: list[str]) -> list[Path]:
    """The recipe directories this command line composes from (shipped, --config-path,
    --config-dir, PRETRAIN_RECIPES), the ones that exist."""
    from hydra._internal.utils import get_args_parser

    return _search_path(get_args_parser().parse_args(argv))[0]


def with_user_recipes(argv: list[str]) -> list[str]:
    """`argv` with `--config-dir $PRETRAIN_RECIPES` in front when the variable is set and the
    command line gives no --config-dir of its own (the flag wins)."""
    from hydra._internal.utils import get_args_parser

    env_dir = env_value(os.environ, RECIPES_ENV)
    if not env_dir or get_args_parser().parse_args(argv).config_dir is not None:
        return argv
    if not Path(env_dir).expanduser().is_dir():
        reason = "no such directory"
        raise RecipeError([Problem(RECIPES_ENV, env_dir, reason, "give a directory of recipes")])
    return ["--config-dir", str(Path(env_dir).expanduser().resolve()), *argv]


def recipe_names(dirs: list[Path]) -> list[str]:
    """The top-level recipes in the search path (base.yaml is shared settings, not one)."""
    names = {
        p.stem for d in dirs for p in d.iterdir()
        if p.suffix in (".yaml", ".yml") and p.name != HYDRA_SETTINGS_FILE
    }  # fmt: skip
    return sorted(names)


def _config_name_problem(name: str) -> Problem | None:
    """A recipe name is looked up in the search path only: no absolute path, no `..`."""
    parts = Path(name).parts
    if Path(name).is_absolute() or name.startswith("~") or ".." in parts:
        reason = "a recipe is named by its file in the search path, not by a path leading out of it"
        fix = "put the file in a directory and give --config-dir DIR --config-name NAME"
        return Problem("--config-name", name, reason, fix)
    return None


def _primary_file(name: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        for suffix in ("", ".yaml", ".yml"):
            path = d / f"{name}{suffix}"
            if path.is_file():
                return path
    return None


def _file_problems(dirs: list[Path], user: list[Path]) -> list[Problem]:
    """Every YAML file of the search path read defensively; the user's own files checked
    like the command line too (the shipped recipes are tested)."""
    problems: list[Problem] = []
    for directory in dirs:
        files = yaml_files(directory)
        if len(files) > MAX_FILES:
            reason = f"holds more than {MAX_FILES} YAML files"
            problems.append(file_problem(directory, reason, "give a directory of recipes"))
            continue
        own = directory in user
        for path in files:
            content, found = load(path) if own else (None, check(path)[1])
            problems += found
            if content is None:
                continue
            text = read_text(path)[0] or ""
            section = package_of(path, directory, text)
            # A folder of the user's own that no recipe section matches is never composed
            # into the recipe; a file whose header places it (anywhere, Hydra's settings
            # included) is checked where it lands.
            placed = has_package_header(text)
            if section and section not in sections() and not placed:
                continue
            problems += content_problems(path, content, section)
            problems += defaults_problems(path, content, dirs)
    return problems


def _argument_problems(argument: str) -> list[Problem]:
    """Length, bracket nesting and encoding of one raw argument."""
    key = argument.split("=", 1)[0].lstrip("+~")[:80] or "argument"
    try:
        argument.encode("utf-8")
    except UnicodeEncodeError:
        return [Problem(key, "...", "the argument is not UTF-8 text", "retype it in UTF-8")]
    if len(argument) > MAX_ARG_CHARS:
        reason = f"the argument is {len(argument):,} characters, more than {MAX_ARG_CHARS:,}"
        return [Problem(key, "...", reason, "put long values in a recipe file")]
    depth = deepest = 0
    for char in argument:
        depth += (char in "[{(") - (char in "]})")
        deepest = max(deepest, depth)
    if deepest > MAX_ARG_DEPTH:
        reason = f"brackets nested {deepest} deep, more than {MAX_ARG_DEPTH}"
        return [Problem(key, "...", reason, "no recipe field is nested that deep")]
    return []


def _unparsable(argument: str, error: Exception) -> Problem:
    """An argument Hydra cannot parse: a key with a look-alike (non-ASCII) character is said
    so, with the key it resembles; anything else gets Hydra's reason and the quoting rule."""
    import unicodedata

    key = argument.split("=", 1)[0].lstrip("+~")
    odd = next((c for c in key if not c.isascii()), None)
    if odd is not None:
        name = unicodedata.name(odd, "an unnamed character")
        reason = f"the key holds {odd!r} (U+{ord(odd):04X} {name}); field names are ASCII"
        ascii_key = unicodedata.normalize("NFKD", key).encode("ascii", "ignore").decode()
        close = difflib.get_close_matches(ascii_key, leaf_types(), n=1, cutoff=0.6)
        fix = f"retype it{f': did you mean {close[0]}?' if close else ''}"
        return Problem(key, argument.partition("=")[2], reason, fix)
    reason = f"Hydra cannot parse it ({str(error).splitlines()[0]})"
    fix = "quote values with spaces or brackets: key='a b'; lists are [a,b]"
    return Problem(key or "argument", argument.partition("=")[2] or argument, reason, fix)


def _values(override: Any) -> list[Any]:
    """The values an override assigns: one, or each of a choice sweep (a,b,c)."""
    if not override.is_sweep_override():
        return [override.value()]
    return list(getattr(override.value(), "list", []))


def _group_problems(override: Any, options: list[str]) -> list[Problem]:
    key = override.key_or_group
    if override.is_delete():
        return []
    problems = []
    for value in _values(override):
        if not isinstance(value, str):
            reason = f"{key} is a config group, which takes the name of one of its options"
            fix = f"use {key}={or_list(options)}, or set its fields as {key}.FIELD=VALUE"
            problems.append(Problem(key, value, reason, fix))
        elif value not in options:
            problems.append(unknown_option(key, value, options))
    return problems


def _field_problems(override: Any) -> list[Problem]:
    key = override.key_or_group
    shown = None if override.is_delete() else override.value()
    if not key_exists(key):
        return [unknown_key(key, shown)]
    if override.is_add() and (key in leaf_types() or key in sections()):
        reason = f"{key} is in the schema already, so '+' would add it a second time"
        return [Problem(f"+{key}", shown, reason, f"drop the '+': {override.input_line[1:]}")]
    if override.is_delete():
        return []
    return [p for v in _values(override) if (p := value_problem(key, v)) is not None]


def _override_problems(arguments: list[str], dirs: list[Path], multirun: bool) -> list[Problem]:
    """Each override parsed and checked on its own, so that every problem is found."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    problems: list[Problem] = []
    for argument in arguments:
        found = _argument_problems(argument)
        if found:
            problems += found
            continue
        try:
            [override] = parser.parse_overrides([argument])
        except OverrideParseException as err:
            problems.append(_unparsable(argument, err))
            continue
        key = override.key_or_group
        if not key.strip("/."):
            fix = "write key=value, e.g. train.steps=100 (see pretrain --help)"
            problems.append(Problem("argument", argument, "no key before the '='", fix))
        elif is_sweeper_setting(key):
            problems += sweeper_problems(override, multirun)
        elif is_hydra_key(key):
            problems.append(hydra_problem(key, argument.partition("=")[2]))
        elif override.package is not None:
            reason = "group@package overrides move a group elsewhere in the recipe"
            field = f"{key}@{override.package}"
            problems.append(Problem(field, override.value(), reason, f"use {key}=OPTION"))
        elif override.is_sweep_override() and not multirun:
            value = argument.partition("=")[2]
            reason = "several values sweep only with -m"
            fix = f"add -m to sweep, or write a list as {key}=[{value}]"
            problems.append(Problem(key, value, reason, fix))
        elif "." not in key and group_options(key, dirs):
            problems += _group_problems(override, group_options(key, dirs))
        else:
            problems += _field_problems(override)
        if override.is_sweep_override():
            problems += _repeated_points(override)
    return problems


def _repeated_points(override: Any) -> list[Problem]:
    """A value listed twice in a sweep makes two points with the same overrides: they would
    share one run dir, the second resuming (or refusing) the first."""
    values = [str(v) for v in _values(override)]
    repeated = sorted({v for v in values if values.count(v) > 1})
    if not repeated:
        return []
    key = override.key_or_group
    kept = ",".join(dict.fromkeys(values))
    reason = f"sweeps {', '.join(repeated)} twice: two points with one run dir"
    return [Problem(key, ",".join(values), reason, f"list each value once: {key}={kept}")]


def flags_first(argv: list[str]) -> list[str]:
    """`argv` with Hydra's flags (and their values) moved before the overrides, in order.

    Hydra's parser takes the overrides as one positional list, so a flag between two
    overrides (`parallel.tp=2 --config-name X action=plan`) leaves the later ones
    unrecognised; users write keys and flags in any order.
    """
    from hydra._internal.utils import get_args_parser

    # argparse keeps no public table of its options: read what each one consumes from it.
    actions = {flag: a for a in get_args_parser()._actions for flag in a.option_strings}
    flags: list[str] = []
    overrides: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        action = actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is None:
            overrides.append(token)
            continue
        flags.append(token)
        if "=" in token or action.nargs == 0:
            continue
        value = next(tokens, None)
        if value is None:  # a flag missing its value stays last, for argparse to name it
            return [*flags[:-1], *overrides, token]
        if action.nargs == "?" and value not in (action.choices or ()):
            overrides.append(value)  # `--info` alone: the next token is an override
        else:
            flags.append(value)
    return [*flags, *overrides]


WRITES_NOTHING = ("plan", "suggest")
"""Actions that write nothing: a sweep of them keeps Hydra's multirun.yaml in a scratch
folder that is removed afterwards."""


def _parsed(arguments: list[str]) -> list[Any]:
    """The overrides Hydra can parse (the others are reported by _override_problems)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for argument in arguments:
        with contextlib.suppress(OverrideParseException):
            parsed += parser.parse_overrides([argument])
    return parsed


def _sweep_problems(arguments: list[str], multirun: bool, confirmed: bool) -> list[Problem]:
    """A sweep's size, counted before Hydra enumerates (and composes) every point."""
    if not multirun:
        return []
    parsed = _parsed([a for a in arguments if not _argument_problems(a)])
    counts = [values_count(o.value()) for o in parsed if o.is_sweep_override()]
    trials = next((o.value() for o in parsed if o.key_or_group == "hydra.sweeper.n_trials"), 20)
    problem = points_problem(counts, trials if isinstance(trials, int) else None, confirmed)
    return [problem] if problem else []


def action_of(arguments: list[str], primary: Path | None) -> str:
    """The action a command line asks for: its last `action=` override, else the recipe
    file's own `action:`, else the schema's default."""
    for override in reversed(
        _parsed([a for a in arguments if a.lstrip("+").startswith("action=")])
    ):
        if isinstance(override.value(), str):
            return str(override.value())
    content = load(primary)[0] if primary is not None else None
    action = content.get("action") if isinstance(content, dict) else None
    return action if isinstance(action, str) else "run"


def checked_command_line(
    argv: list[str], default_recipe: str, confirmed: bool = False
) -> list[str]:
    """The arguments to hand Hydra: `argv` plus QUIET_HYDRA, once the command line and the
    recipe files are found sound (a sweep of more than MAX_SWEEP_POINTS points needs
    `confirmed`, the `--yes` flag). Raises RecipeError listing every problem."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return argv
    dirs, user, problems = _search_path(args)
    name = (args.config_name or default_recipe).removesuffix(".yaml")
    name_problem = _config_name_problem(name)
    primary = None if name_problem else _primary_file(name, dirs)
    if name_problem:
        problems.append(name_problem)
    elif primary is None:
        recipes = recipe_names(dirs)
        problems.append(unknown_option("--config-name", name, recipes, "no such recipe"))
    problems += _file_problems(dirs, user)
    problems += _override_problems(args.overrides, dirs, args.multirun)
    problems += _sweep_problems(args.overrides, args.multirun, confirmed)
    if problems:
        raise RecipeError(problems)
    return [*argv, *QUIET_HYDRA]


@contextlib.contextmanager
def sweep_scratch(argv: list[str], default_recipe: str) -> Iterator[list[str]]:
    """The Hydra settings a sweep of an action that writes nothing adds (Hydra writes its
    multirun.yaml to the sweep dir before the first point: here a scratch folder, removed
    when the sweep ends); none for anything else."""
    import shutil
    import tempfile

    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    name = (args.config_name or default_recipe).removesuffix(".yaml")
    primary = _primary_file(name, _search_path(args)[0])
    if not args.multirun or action_of(args.overrides, primary) not in WRITES_NOTHING:
        yield []
        return
    scratch = tempfile.mkdtemp(prefix="pretrain-sweep-")
    try:
        yield [f"hydra.sweep.dir={scratch}"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _given_value(override: str) -> str | None:
    """The value `override` (`+key`) was given on the command line, as typed; None if it is
    not there (Hydra's message names the key alone)."""
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"{override}=")]
    return given[-1] if given else None


def _override_said(message: str) -> Problem | None:
    """Hydra's words for a `+key` given twice or a `~key` not in the recipe, in ours."""
    import re

    added = re.search(r"Could not append to config\. An item is already at '([^']+)'", message)
    if added:
        key = added.group(1)
        reason = f"{key} is set already (by the recipe, or by an earlier +{key})"
        value = _given_value(f"+{key}")
        fix = f"give it once; without '+' to change it: {key}={value or 'V'}"
        return Problem(f"+{key}", value, reason, fix)
    deleted = re.search(r"Could not delete from config\. '([^']+)' does not exist", message)
    if deleted:
        key = deleted.group(1)
        reason = f"{key} is not in the composed recipe, so there is nothing to remove"
        return Problem(f"~{key}", None, reason, f"drop ~{key} (see `pretrain --cfg job`)")
    return None


def translate(error: Exception) -> list[Problem] | None:
    """Hydra's or OmegaConf's error as problems; None for errors of other kinds."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(error, MissingConfigException):
        missing = error.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if error.options:
            return [unknown_option(group or "recipe", option, list(error.options))]
        return [Problem("--config-name", missing, "no such recipe", "see recipes/")]
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    if not isinstance(cause, (HydraException, OmegaConfBaseException)):
        return None
    said = _override_said(str(cause))
    if said is not None:
        return [said]
    lines = [line for line in str(cause).splitlines() if line.strip()]
    field = getattr(cause, "full_key", None) or "recipe"
    value = getattr(cause, "value", None)
    reason = lines[0] if lines else type(cause).__name__
    if field != "recipe" and not key_exists(field):
        return [unknown_key(field, value)]
    return [Problem(field, value, reason, "see `pretrain --cfg job` for the composed recipe")]


@contextlib.contextmanager
def hydra_errors_as_problems() -> Iterator[None]:
    """Run Hydra so that its errors reach us (HYDRA_FULL_ERROR) and re-raise them as one
    RecipeError; other errors pass unchanged."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as error:
        problems = None if isinstance(error, RecipeError) else translate(error)
        if problems is None:
            raise
        raise RecipeError(problems) from error
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
