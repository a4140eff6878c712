"""The README's "A few commands", run in the order it gives them after the default run, in
one fresh directory: each does what its comment says, and none trips over what an earlier
one left (a run dir of another run, a finished run resumed, a sweep inside an old run).

Commands that train run with the harness model's overrides appended (the keys a command
sets itself are kept as written), so the sequence trains in seconds; what is checked is
the order: the run dirs, the files each command reads from the one before, and what a
command that finds a finished run says. Commands that need something a test machine lacks
(W&B credentials, a search of 20 trials, a submission to SLURM, the user's own data, a
full-size dry run) are in SKIPPED with the test that covers them.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.distributed.harness import BASE_OVERRIDES
from tests.helpers import REPO, generated_documents, pretrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SKIPPED = {
    "action=dryrun": "a full-size dry run (tests/unit/test_dryrun.py)",
    "hydra/sweeper=optuna": "a search of 20 trials (tests/e2e/test_sweeps.py)",
    "dashboard": "needs W&B credentials (tests/e2e/test_dashboard.py)",
    "cluster=slurm": "submits to SLURM (tests/slurm)",
    "data.sources=": "the user's own a/ and b.bin (tests/distributed/test_prepared_data.py)",
}
SUBCOMMANDS = ("status", "report", "export", "diff")


def readme_commands() -> list[list[str]]:
    """The default run, then every command of the README's "A few commands" block."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## A few commands") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [["pretrain"], *(words for words in commands if words[:1] == ["pretrain"])]


def shrunk(args: list[str]) -> list[str]:
    """`args` with the harness model's overrides for every key it does not set itself; a
    run from HF weights keeps the checkpoint's model (it adopts it)."""
    own = {a.split("=", 1)[0] for a in args if "=" in a}
    adopts = any(a.startswith("init.from_hf=") for a in args)
    extra = [
        o
        for o in BASE_OVERRIDES
        if o.split("=", 1)[0] not in own and not (adopts and o.startswith("model."))
    ]
    return [*args, *extra]


def test_the_readme_commands_run_in_the_order_given(tmp_path: Path) -> None:
    commands = readme_commands()
    assert len(commands) > 10
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(generated_documents(40)):
        (corpus / f"doc{i}.txt").write_text(doc)
    calibrations = tmp_path / "calibration-cache"
    done = []
    for words in commands:
        args = words[1:]
        if any(marker in a for a in args for marker in SKIPPED):
            continue
        # What trains or prepares gets the harness model; plans and commands run as written.
        actions = [a for a in args if a.startswith("action=")]
        small = args[:1] != ["-m"] and args[:1] not in [[c] for c in SUBCOMMANDS]
        small = small and actions in ([], ["action=prepare"])
        # A calibration is kept in the cache every later plan reads (data.cache_dir): this
        # one goes to a cache of its own, or it would set the step times and first-step
        # timeouts of the suite's other runs.
        own_cache = {"PRETRAIN_CACHE_DIR": str(calibrations)} if "action=calibrate" in args else {}
        result = pretrain(
            *(shrunk(args) if small else args), cwd=tmp_path, timeout=300, env=own_cache
        )
        said = f"pretrain {shlex.join(args)}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        assert result.returncode == 0, said
        done.append(args)
    runs = tmp_path / "runs"
    # Every run that trained has a run dir of its own, each with its own finished curve.
    trained = {"tiny", "from-hf", "zero3", "tb"}
    assert trained <= {p.name for p in runs.iterdir()}
    for name in trained:
        rows = [
            json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert rows and rows[-1]["step"] == (50 if name == "zero3" else 8), name
    assert list((runs / "tb" / "tensorboard").rglob("events.out.tfevents.*"))
    assert (tmp_path / "hf" / "tiny" / "config.json").is_file()
    assert (runs / "tiny" / "report.png").is_file()
    assert sorted(p.name for p in (runs / "lr").iterdir() if p.is_dir()) == [
        "optim.lr=0.001",
        "optim.lr=0.003",
    ]
    assert (runs / "mine" / "prepare.yaml").is_file()
    assert list((calibrations / "hardware").glob("calibration-*.json"))
    assert len(done) >= 11

    # The default run again: it says it finished and what to do, and trains nothing.
    before = (runs / "tiny" / "metrics.jsonl").read_bytes()
    again = pretrain(*shrunk([]), cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished" in again.stderr
    assert (runs / "tiny" / "metrics.jsonl").read_bytes() == before
