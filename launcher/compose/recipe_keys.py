"""What the schema accepts at a dotted key: whether the key exists (with a did-you-mean when
it does not) and whether a value converts to the field's type, the way OmegaConf would.

The command-line checks and the recipe-file checks ask these questions before Hydra
composes, so that every unknown key and badly typed value is reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any

from pretrain.core.problems import Problem, or_list
from pretrain.core.schema import RecipeConfig


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def leaf_types() -> dict[str, Any]:
    """Dotted path -> type of every leaf field of the recipe (dicts and lists are leaves)."""
    found: dict[str, Any] = {}

    def walk(cls: Any, prefix: str) -> None:
        for name, hint in _hints(cls).items():
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")
            else:
                found[f"{prefix}{name}"] = hint

    walk(RecipeConfig, "")
    return found


@functools.cache
def sections() -> dict[str, Any]:
    """Dotted path -> dataclass of every section ('' is the whole recipe)."""
    found: dict[str, Any] = {"": RecipeConfig}

    def walk(cls: Any, prefix: str) -> None:
        for name, hint in _hints(cls).items():
            if dataclasses.is_dataclass(hint):
                found[f"{prefix}{name}"] = hint
                walk(hint, f"{prefix}{name}.")

    walk(RecipeConfig, "")
    return found


def _dict_parent(path: str) -> str | None:
    """The dict-typed field `path` lies inside (cluster.env.X -> cluster.env), if any."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if typing.get_origin(leaf_types().get(parent)) is dict:
            return parent
    return None


def key_exists(path: str) -> bool:
    """Whether `path` names a field, a section, or a key inside a dict field."""
    return path in leaf_types() or path in sections() or _dict_parent(path) is not None


def did_you_mean(path: str) -> str:
    """A fix for an unknown key: the closest fields of its section, else the closest keys
    of the whole recipe, else the section's fields."""
    known = sorted(set(leaf_types()) | {p for p in sections() if p})
    section, _, last = path.rpartition(".")
    if section in sections():
        names = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
        close = [
            f"{section}.{n}" if section else n
            for n in difflib.get_close_matches(last, names, n=3, cutoff=0.5)
        ]
    else:
        close = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
    if close:
        return f"did you mean {or_list(close)}?"
    while section and section not in sections():
        section = section.rpartition(".")[0]
    fields = [f.name for f in dataclasses.fields(sections()[section])]
    where = f"{section} has" if section else "a recipe has"
    return f"{where} {', '.join(fields)} (see core/schema.py)"


def unknown_key(path: str, value: Any) -> Problem:
    """The problem of a key the schema does not have."""
    return Problem(path, value, "no such key in the recipe schema", did_you_mean(path))


def _leaf_type(path: str) -> Any:
    if path in leaf_types():
        return leaf_types()[path]
    parent = _dict_parent(path)
    if parent is not None:
        return typing.get_args(leaf_types()[parent])[1]
    return None


_NAMES = {
    int: ("a whole number", "whole numbers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "true/false values"),
    str: ("a string", "strings"),
}


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        element = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(element):
            fields = ", ".join(f.name for f in dataclasses.fields(element))
            return f"a list of mappings with {fields}"
        return f"a list of {_NAMES[element][1]}"
    if origin is dict:
        element = typing.get_args(hint)[1]
        return "a mapping" if element is Any else f"a mapping of names to {_NAMES[element][1]}"
    return _NAMES[hint][0]


def value_problem(path: str, value: Any) -> Problem | None:
    """The problem of assigning `value` to the field `path`, as OmegaConf would convert it;
    None when it converts (or is an interpolation, which only composition can resolve)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

    hint = _leaf_type(path)
    if hint is None or hint is Any or (isinstance(value, str) and "${" in value):
        return None  # Any: a value of a free mapping (model.rope_scaling), checked by validate
    origin = typing.get_origin(hint)
    try:
        if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            # A list of structured entries (data.sources): each one merged onto its schema.
            if not isinstance(value, list):
                raise ValueError("not a list")
            for item in value:
                OmegaConf.merge(OmegaConf.structured(typing.get_args(hint)[0]), item)
        elif origin is list:
            ListConfig(content=value, element_type=typing.get_args(hint)[0])
        elif origin is dict:
            DictConfig(content=value, key_type=str, element_type=typing.get_args(hint)[1])
        elif value is None:
            raise ValueError("no value")
        else:
            nodes: dict[Any, Any] = {
                int: IntegerNode,
                float: FloatNode,
                bool: BooleanNode,
                str: StringNode,
            }
            nodes[hint](value)
    except (OmegaConfBaseException, ValueError, TypeError):
        return Problem(path, value, f"not {_type_name(hint)}", f"give {_type_name(hint)}")
    return None
