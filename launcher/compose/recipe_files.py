"""Recipe files read defensively, before Hydra loads any of them.

Hydra and OmegaConf trust their YAML: an alias bomb hangs them, deep nesting overflows the
stack, a binary file ends in a traceback, and a `hydra:` block can run code (callbacks) or
write files anywhere. Every YAML file on the config search path is first checked here for
size, UTF-8 text, YAML syntax, aliases and nesting depth (on the parser's events, so
nothing is expanded); the user's own recipe files are then checked like the command line:
no Hydra settings, keys the schema has, values of the field's type, defaults that exist.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from pretrain.core.inputs.reading import (
    ReadError,
    read_bytes,
    yaml_shape_problem,
)
from pretrain.core.problems import Problem, or_list
from pretrain.launcher.compose.recipe_keys import key_exists, leaf_types, unknown_key, value_problem

MAX_BYTES = 1 << 20
"""A recipe larger than 1 MiB is not a recipe (the shipped ones are under 2 KiB)."""
MAX_FILES = 2000
"""YAML files per config dir that are checked; more is a wrong --config-dir."""
HYDRA_SETTINGS_FILE = "base.yaml"
"""The shipped file that holds the launcher's own Hydra settings (the only `hydra:` block)."""

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def file_problem(path: Path, reason: str, fix: str) -> Problem:
    """A problem of a recipe file as a whole."""
    return Problem("recipe file", str(path), reason, fix)


def _refused(path: Path, reason: str, fix: str) -> tuple[None, list[Problem]]:
    return None, [file_problem(path, reason, fix)]


def yaml_files(directory: Path) -> list[Path]:
    """The YAML files under `directory`, in a stable order (at most MAX_FILES + 1)."""
    found: list[Path] = []
    for path in sorted(directory.rglob("*")):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            found.append(path)
            if len(found) > MAX_FILES:
                break
    return found


def read_text(path: Path) -> tuple[str | None, list[Problem]]:
    """The text of a recipe file, or the problems that stop it being read."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        return _refused(
            path,
            f"{size:,} bytes, more than the {MAX_BYTES:,} a recipe may have",
            "a recipe lists fields and groups; put data elsewhere",
        )
    try:
        raw = read_bytes(path, "a recipe file (YAML)", MAX_BYTES)
    except ReadError as err:
        return _refused(path, err.found, err.fix)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _refused(
            path,
            f"not UTF-8 text (byte {err.start} is {raw[err.start]:#04x})",
            "save it as UTF-8 YAML",
        )
    control = _CONTROL.search(text)
    if control:
        line = text.count("\n", 0, control.start()) + 1
        return _refused(
            path,
            f"holds a control character {control.group()!r} on line {line} (binary?)",
            "give a YAML text file",
        )
    return text, []


def _event_problems(path: Path, text: str) -> list[Problem]:
    """Syntax, aliases and depth, from the parser's events (nothing is constructed)."""
    reason = yaml_shape_problem(text)
    if reason is None:
        return []
    if reason.startswith("not valid YAML"):
        fix = "fix the YAML syntax"
    elif "anchors" in reason:
        fix = "write the values out; a recipe needs few anchors (an alias bomb needs many)"
    else:
        fix = "a recipe's fields are at most three levels deep"
    return [file_problem(path, reason, fix)]


def check(path: Path) -> tuple[str | None, list[Problem]]:
    """A recipe file's text once it is known to be safe to construct, or its problems."""
    text, problems = read_text(path)
    if text is None:
        return None, problems
    problems = _event_problems(path, text)
    return (None, problems) if problems else (text, [])


def load(path: Path) -> tuple[Any, list[Problem]]:
    """A recipe file's content once it is known to be safe to construct, or its problems."""
    text, problems = check(path)
    if text is None:
        return None, problems
    content = yaml.load(text, Loader=_Loader)
    if content is not None and not isinstance(content, dict):
        kind = type(content).__name__
        return None, [
            file_problem(path, f"holds a {kind}, not a mapping of fields", "see recipes/tiny.yaml")
        ]
    return content or {}, []


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a recipe mapping; dict fields stay whole."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not _is_dict_field(path):
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def _is_dict_field(path: str) -> bool:
    return typing.get_origin(leaf_types().get(path)) is dict


def header_package(text: str) -> str | None:
    """The `# @package` of a file's header as Hydra reads it (every leading `# @key value`
    line, not only the first), or None; a header Hydra would refuse reads as None here and
    Hydra's own error follows."""
    from hydra.plugins.config_source import ConfigSource

    try:
        return ConfigSource._get_header_dict(text).get("package")
    except ValueError:
        return None


def package_of(path: Path, config_dir: Path, text: str | None = None) -> str:
    """The recipe section a file's content lands in: its group folder, or the whole recipe
    (a `# @package` header says otherwise: `_global_` is the whole recipe, `_group_` the
    folder, `_global_.a.b` is `a.b`)."""
    if text is None:
        text, _ = read_text(path)
    relative = path.relative_to(config_dir).parent.as_posix()
    group = "" if relative == "." else relative.replace("/", ".")
    package = header_package(text or "")
    if package is None:
        return group
    parts = [group if part == "_group_" else part for part in package.split(".")]
    if parts[0] == "_global_":
        parts = parts[1:]
    return ".".join(part for part in parts if part)


def has_package_header(text: str) -> bool:
    """Whether a file's header names its package (so its folder does not decide)."""
    return header_package(text) is not None


def is_hydra_key(key: str) -> bool:
    """Whether a dotted key, group path or package lies in Hydra's own settings."""
    key = key.strip().lstrip("/")
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def content_problems(path: Path, content: dict, section: str) -> list[Problem]:
    """Hydra settings, unknown keys and badly typed values in a user's recipe file."""
    prefix = f"{section}." if section else ""
    problems = []
    for key, value in _leaves({k: v for k, v in content.items() if k != "defaults"}, prefix):
        if is_hydra_key(key):
            problem: Problem | None = hydra_problem(key, value)
        elif not key_exists(key):
            problem = unknown_key(key, value)
        else:
            problem = value_problem(key, value)
        if problem is not None:
            problem.reason = f"in {path}: {problem.reason}"
            problems.append(problem)
    return problems


def hydra_problem(field: str, value: Any) -> Problem:
    """Hydra's own settings may not come from recipes or the command line."""
    return Problem(
        field,
        value,
        "Hydra's own settings (callbacks, launchers, sweepers, search path, output and "
        "logging) can run code or write files outside the run dir, so recipes and the "
        "command line may not set them",
        "remove it; the launcher's Hydra settings live in recipes/base.yaml (a sweep may "
        "choose its sweeper: hydra/sweeper=optuna, see docs/sweeps.md)",
    )


def defaults_problems(path: Path, content: dict, dirs: list[Path]) -> list[Problem]:
    """Entries of a user file's defaults list: no Hydra groups or packages (`x@hydra`),
    options that exist."""
    problems = []
    for entry in content.get("defaults") or []:
        if isinstance(entry, str):
            entry = {entry: None}
        if not isinstance(entry, dict):
            continue
        for raw_key, option in entry.items():
            key = str(raw_key).removeprefix("override ").removeprefix("optional ").strip()
            group, _, package = key.lstrip("/").partition("@")
            package = package.removeprefix("_global_").lstrip(".")
            field = f"defaults: {raw_key}"
            if is_hydra_key(group) or is_hydra_key(package):
                problem: Problem | None = hydra_problem(field, option)
            elif isinstance(option, str) and "optional" not in str(raw_key):
                options = group_options(group, dirs)
                bad = options and option not in options
                problem = unknown_option(field, option, options) if bad else None
            else:
                problem = None
            if problem is not None:
                problem.reason = f"in {path}: {problem.reason}"
                problems.append(problem)
    return problems


def group_options(group: str, dirs: list[Path]) -> list[str]:
    """The options of a config group (e.g. precision: bf16, fp16, ...) in the search path."""
    found = {
        p.stem for d in dirs if (d / group).is_dir() for p in (d / group).iterdir()
        if p.suffix in (".yaml", ".yml")
    }  # fmt: skip
    return sorted(found)


def unknown_option(
    field: str, option: Any, options: list[str], reason: str = "no such option"
) -> Problem:
    """A group option (or recipe) that does not exist, with the ones that do."""
    close = difflib.get_close_matches(str(option), options, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    return Problem(field, option, reason, f"{hint}use {or_list(options)}")
