"""One way of reporting what is wrong with a recipe: `Problem`s collected into a `RecipeError`.

Every rule, wherever it lives, adds `Problem(field, value, reason, fix)` to a `Checks`
collector; the caller raises one `RecipeError` listing them all, so a user fixes a recipe
in one pass. The small formatting helpers the messages share live here too.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Problem:
    """One thing wrong with a recipe: where, what, why, and how to fix it."""

    field: str
    value: Any
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}={show_value(self.value)}: {self.reason}; {self.fix}"


class RecipeError(ValueError):
    """A recipe that cannot be planned or run; `problems` holds every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def show_value(value: Any) -> str:
    """A value as it would be written in a Hydra override."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (not value or re.search(r"[\s'\"=,]", value)):
        return repr(value)
    return str(value)


class Checks:
    """Collects problems; the helpers keep each rule to a line or two."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, field: str, value: Any, reason: str, fix: str) -> None:
        """Record one problem."""
        self.problems.append(Problem(field, value, reason, fix))

    def extend(self, problems: list[Problem]) -> None:
        """Record problems found elsewhere (a RecipeError's, another rule set's)."""
        self.problems.extend(problems)

    def choice(self, field: str, value: str, allowed: tuple[str, ...]) -> bool:
        """`value` is one of `allowed`; True when it is."""
        if value in allowed:
            return True
        self.add(field, value, f"unknown value {value!r}", f"use {or_list(list(allowed))}")
        return False

    def finite(self, field: str, value: float) -> bool:
        """`value` is a number, not nan or infinite; True when it is."""
        if isinstance(value, int) or math.isfinite(value):
            return True
        self.add(field, value, "must be a finite number", "use a number such as 1 or 0.5")
        return False

    def at_least(self, field: str, value: float, minimum: float) -> bool:
        """`value` >= `minimum` (and finite); True when it is."""
        if not self.finite(field, value):
            return False
        if value >= minimum:
            return True
        self.add(field, value, f"must be >= {minimum}", f"use a value >= {minimum}")
        return False

    def at_most(self, field: str, value: float, maximum: float, why: str) -> bool:
        """`value` <= `maximum`; `why` says what larger values would mean. True when it is."""
        if value <= maximum:
            return True
        self.add(field, value, f"must be <= {maximum:,} ({why})", f"use a value <= {maximum:,}")
        return False

    def positive(self, field: str, value: float) -> bool:
        """`value` > 0 (and finite); True when it is."""
        if not self.finite(field, value):
            return False
        if value > 0:
            return True
        self.add(field, value, "must be > 0", "use a positive value")
        return False

    def reported(self, field: str) -> bool:
        """Whether a problem of `field` is recorded already."""
        return any(p.field == field for p in self.problems)

    def raise_if_any(self) -> None:
        """Raise one RecipeError listing every problem recorded, if there is any."""
        if self.problems:
            raise RecipeError(self.problems)


TRIAL_DIVISION_LIMIT = 1_000_000
"""Factors are sought by trial division up to this bound (and the square root): a number
of any size is factored in at most a million steps; a cofactor left above the bound is
taken as prime (always right below 10**12, and a divisor list only advises)."""


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n > 0, by trial division (see TRIAL_DIVISION_LIMIT)."""
    factors: dict[int, int] = {}
    d = 2
    while d * d <= n and d <= TRIAL_DIVISION_LIMIT:
        while n % d == 0:
            factors[d] = factors.get(d, 0) + 1
            n //= d
        d += 1 if d == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def divisors(n: int) -> list[int]:
    """Positive divisors of n in ascending order, from its factors (never n steps)."""
    if n <= 0:
        return []
    found = [1]
    for prime, exponent in prime_factors(n).items():
        found = [d * prime**k for d in found for k in range(exponent + 1)]
    return sorted(found)


def nearby_multiples(value: int, step: int) -> list[int]:
    """The positive multiples of `step` just below and just above `value`."""
    below = value // step * step
    return [v for v in (below, below + step) if v > 0] if step > 0 else []


MAX_LISTED = 16
"""Most choices a message lists; a longer list keeps its first and last few."""


def or_list(values: Sequence[object]) -> str:
    """Choices as prose: '1, 2, 4 or 8' (a long list: '1, 2, ..., 96 more, ... or 720')."""
    words = [str(v) for v in values]
    if len(words) > MAX_LISTED:
        head, tail = words[: MAX_LISTED // 2], words[-MAX_LISTED // 4 :]
        words = [*head, f"({len(words) - len(head) - len(tail):,} more)", *tail]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


EXTRAS = {
    "wandb": "wandb",
    "datasets": "hf",
    "pyarrow": "hf",
    "tensorboard": "tensorboard",
    "torchao": "fp8",
    "wandb_workspaces": "dashboard",
    "lm_eval": "lm-eval",
}
"""Optional package (its import name) -> the extra of this project that installs it: the
default install runs the default recipe, each extra one feature."""


def installed(module: str) -> bool:
    """Whether `module` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


def install_fix(module: str) -> str:
    """The command that installs `module` with this project's extra for it."""
    extra = EXTRAS.get(module)
    return f"pip install 'pretrain[{extra}]'" if extra else f"pip install {module}"
