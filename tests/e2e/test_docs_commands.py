"""Every `pretrain` command in the README and docs/ composes, validates and plans as written:
a renamed field, a removed option or a refused layout in the docs fails here.

Commands that only read or plan (`--help`, `--cfg`, `action=plan|suggest|script`) run as
written; commands that would train or prepare run with `action=plan` appended, which
composes and validates them without starting a job (the training itself is tested by the
suites that launch). Commands that need something of the user's (their own recipe folder,
a run dir, W&B credentials) or a search plugin's trials are listed in SKIPPED with why.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import REPO, pretrain_in_process

pytestmark = pytest.mark.e2e

DOCUMENTS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
READ_ONLY = ("--help", "-h", "--cfg", "action=plan", "action=suggest", "action=script")
SKIPPED = {
    "--config-dir": "the user's own recipe folder",
    "status": "needs a run dir (tests/unit/test_status.py)",
    "diff": "needs two run dirs (tests/unit/test_diff.py)",
    "report": "needs a run dir (tests/unit/test_report.py)",
    "export": "needs a checkpoint (tests/e2e/test_export.py)",
    "dashboard": "needs W&B credentials (tests/e2e/test_dashboard.py)",
    "hydra/sweeper=optuna": "a search runs trials (tests/e2e/test_sweeps.py)",
}


def doc_commands() -> list[tuple[str, str]]:
    """(document, command) of every `pretrain` line in a shell block, continuations joined
    and comments dropped."""
    found = []
    for doc in DOCUMENTS:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["pretrain"]:
                    found.append((doc.name, shlex.join(words[1:])))
    return found


COMMANDS = doc_commands()


def test_the_docs_hold_commands_to_check() -> None:
    assert len(COMMANDS) > 30
    assert {doc for doc, _ in COMMANDS} >= {"README.md", "planning.md", "parallelism.md"}


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c}" for d, c in COMMANDS])
def test_a_documented_command_composes_validates_and_plans(
    doc: str, command: str, tmp_path: Path
) -> None:
    args = shlex.split(command)
    skipped = [why for marker, why in SKIPPED.items() if marker in args or args[:1] == [marker]]
    if skipped:
        pytest.skip(skipped[0])
    if not any(a in READ_ONLY or a.startswith(("--cfg", "action=")) for a in args):
        args.append("action=plan")
    elif any(a.startswith("action=") and a not in READ_ONLY for a in args):
        args = [a for a in args if not a.startswith("action=")] + ["action=plan"]
    code, out, err = pretrain_in_process(*args, cwd=tmp_path)
    assert code == 0, f"{doc}: pretrain {command}\n{err[-2000:]}"
    assert out.strip()


def test_the_validation_example_in_the_docs_is_what_the_launcher_prints(tmp_path: Path) -> None:
    text = (REPO / "docs" / "recipes-and-cli.md").read_text()
    command, printed = re.search(
        r"`pretrain ([^`]*)`\s*prints\s*```\n(.*?)```", text, re.S
    ).groups()
    code, _, err = pretrain_in_process(*shlex.split(command), cwd=tmp_path)
    assert code == 2
    assert err.strip().splitlines() == printed.strip().splitlines()
