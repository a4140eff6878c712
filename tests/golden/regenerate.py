"""Rewrite the golden curves on purpose: `python -m tests.golden.regenerate [NAME ...]`.

Run it only when a change is meant to move the curves (say why in the commit), from the
repository root with the project installed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.golden.cases import CASES, run_case, write_golden


def main(names: list[str]) -> None:
    chosen = [c for c in CASES if not names or c.name in names]
    with tempfile.TemporaryDirectory() as tmp:
        for case in chosen:
            curve = run_case(case, Path(tmp) / case.name)
            write_golden(case, curve)
            print(f"{case.path}: loss {curve.loss[0]:.4f} -> {curve.loss[-1]:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
