"""String fields with a fixed set of values: the set is written once, beside the field."""

from __future__ import annotations

from dataclasses import field
from typing import Any

CHOICES = "choices"
"""Metadata key of a string field's allowed values (see `one_of`)."""


def one_of(default: str, allowed: tuple[str, ...]) -> Any:
    """A dataclass field whose value must be one of `allowed`: validation, `--help` and the
    factories read the tuple from the field's metadata, so each list is written once."""
    if default not in allowed:
        raise ValueError(f"default {default!r} is not one of {allowed}")
    return field(default=default, metadata={CHOICES: allowed})
