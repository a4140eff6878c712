"""Each recipe field's documentation, read from the docstring under its declaration in the
schema's dataclasses (the one place a field is documented), for `pretrain --help`."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from pretrain.core.choices import CHOICES


@dataclass(frozen=True)
class FieldDoc:
    """One leaf field of the recipe: its dotted path, default, allowed values and doc."""

    path: str
    default: Any
    choices: tuple[str, ...]
    doc: str


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right after its declaration} of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for declared, after in itertools.pairwise(body):
        if not (isinstance(declared, ast.AnnAssign) and isinstance(declared.target, ast.Name)):
            continue
        literal = after.value if isinstance(after, ast.Expr) else None
        if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
            docs[declared.target.id] = inspect.cleandoc(literal.value)
    return docs


def field_docs(cls: type, prefix: str = "") -> Iterator[FieldDoc]:
    """Every leaf field under the dataclass `cls`, in declaration order."""
    docs = attribute_docs(cls)
    for f in fields(cls):
        sub = f.default_factory if callable(f.default_factory) else None
        if sub is not None and is_dataclass(sub):
            yield from field_docs(sub, f"{prefix}{f.name}.")
            continue
        if f.default is not MISSING:
            default = f.default
        elif sub is not None:
            default = sub()
        else:
            default = None
        doc = " ".join(docs.get(f.name, "").split())
        yield FieldDoc(prefix + f.name, default, f.metadata.get(CHOICES, ()), doc)
