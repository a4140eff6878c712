"""`pretrain diff RUN_A RUN_B`: what differs in config, code, environment and plan between two
run dirs the launcher wrote, where their curves part, and run dirs it cannot read in full."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain.core.run.ledger import append_record, read_ledger
from pretrain.core.run.rundir import LEDGER_FILE, METRICS_FILE
from pretrain.launcher.job.diff import override_value, parting
from pretrain.launcher.job.run_record import losses
from tests.helpers import pretrain_in_process


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two run dirs written by `pretrain action=script` that differ in optim.lr; B's ledger
    then says it ran on another torch."""
    root = tmp_path_factory.mktemp("diff")
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        code, _, err = pretrain_in_process(
            "action=script", f"run.dir={root / name}", f"optim.lr={lr}", cwd=root
        )
        assert code == 0, err
    records, _ = read_ledger(root / "b") or ([], 0)
    records[0]["packages"]["torch"] = "2.12.0"
    (root / "b" / LEDGER_FILE).unlink()
    append_record(root / "b", records[0])
    return root / "a", root / "b"


def diff(*args: str | Path, cwd: Path) -> tuple[int, str, str]:
    return pretrain_in_process("diff", *map(str, args), cwd=cwd)


def write_losses(run_dir: Path, by_step: dict[int, float | None]) -> None:
    rows = [json.dumps({"step": s, "loss": v, "lr": 1e-3}) for s, v in by_step.items()]
    (run_dir / METRICS_FILE).write_text("\n".join(rows) + "\n")


def test_diff_names_the_one_override_and_the_one_package_that_differ(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = two_runs
    code, out, err = diff(a, b, "--format", "json", cwd=tmp_path)
    assert code == 0, err
    found = json.loads(out)
    assert found["config"] == [{"field": "optim.lr", "a": 0.001, "b": 0.003}]
    torch_a = (read_ledger(a) or ([{}], 0))[0][0]["packages"]["torch"]
    assert found["environment"] == [{"field": "torch", "a": torch_a, "b": "2.12.0"}]
    assert found["code"]["a"] == found["code"]["b"]
    assert found["plan"] == []  # the learning rate changes nothing the plan counts
    assert found["overrides"]["b"][-1] == "optim.lr=3e-3"

    code, text, _ = diff(a, b, cwd=tmp_path)
    assert code == 0
    lines = text.splitlines()
    at = lines.index("config (run.dir aside): 1 differs")
    assert lines[at + 1 : at + 3] == ["  - optim.lr=0.001", "  + optim.lr=0.003"]
    at = lines.index("environment: 1 differs")
    assert lines[at + 1 : at + 3] == [f"  - torch={torch_a}", "  + torch=2.12.0"]
    assert "plan: the same" in lines
    at = lines.index("overrides: launched with")
    assert lines[at + 1 : at + 3] == [
        f"  - run.dir={a} optim.lr=1e-3",
        f"  + run.dir={b} optim.lr=3e-3",
    ]


def test_the_curves_part_at_the_first_common_step_beyond_the_tolerance(tmp_path: Path) -> None:
    a = {1: 5.0, 2: 4.5, 3: 4.0, 4: 3.6, 5: 3.3, 6: 3.1}
    b = {1: 5.0, 2: 4.5 * (1 + 5e-5), 4: 3.6 * (1 + 2e-4), 5: 3.0, 6: 2.9}  # 3 not logged
    part = parting(a, b, rtol=1e-4)
    assert (part.step, part.a, part.b, part.common_steps) == (4, 3.6, b[4], 5)
    assert parting(a, b, rtol=1e-3).step == 5
    assert parting(a, a, rtol=0).step is None
    # A loss logged as not finite (null) parts from a finite one.
    assert parting({1: 5.0, 2: 4.0}, {1: 5.0, 2: None}, rtol=1e-4).step == 2

    # Read back from metrics.jsonl: a step logged again after a resume counts last, a line
    # cut by a crash and a row without a loss are skipped.
    write_losses(tmp_path, {1: 5.0, 2: 4.0})
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 2, "loss": 4.25}\n{"step": 3, "val_loss": 3.0}\n{"step": 4, "lo')
    assert losses(tmp_path) == {1: 5.0, 2: 4.25}


def test_diff_says_where_two_runs_curves_part(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = (Path(shutil.copytree(run, tmp_path / run.name)) for run in two_runs)
    write_losses(a, {1: 5.0, 2: 4.5, 3: 4.0})
    write_losses(b, {1: 5.0, 2: 4.4, 3: 3.9})
    code, out, _ = diff(a, b, cwd=tmp_path)
    assert code == 0
    assert out.splitlines()[-1].startswith("curves: part at step 2: loss 4.5 (A) vs 4.4 (B)")
    code, out, _ = diff(a, b, "--format", "json", "--rtol", "0.1", cwd=tmp_path)
    curves = json.loads(out)["curves"]
    assert curves["parting_step"] is None and curves["common_steps"] == 3


def test_the_code_is_the_first_jobs_and_a_change_of_code_on_a_resume_is_noted(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = (Path(shutil.copytree(run, tmp_path / run.name)) for run in two_runs)
    launch = (read_ledger(b) or ([{}], 0))[0][0]
    for commit in ("1" * 40, "2" * 40):  # the job, then its resume under another commit
        job = {"kind": "job", "code": {"git_commit": commit, "dirty": False}, "hosts": ["n1"]}
        append_record(b, {**job, "packages": launch["packages"]})
    code, out, err = diff(a, b, "--format", "json", cwd=tmp_path)
    assert code == 0, err
    found = json.loads(out)
    assert found["code"]["b"] == "git 111111111111" and found["hosts"]["b"] == ["n1"]
    assert (
        f"B ran under 3 code versions, in this order: {found['code']['a']}; git 111111111111; "
        "git 222222222222"
    ) in found["notes"]
    assert not any(note.startswith("A ran under") for note in found["notes"])


def test_a_run_dir_from_before_the_ledger_is_said_so_and_its_config_still_compared(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = two_runs
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.yaml", "overrides.yaml"):
        (old / name).write_text((b / name).read_text())
    code, out, err = diff(a, old, cwd=tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    assert "  + optim.lr=0.003" in lines
    assert (
        "note: B has no ledger.jsonl (a run dir from a version before the ledger): its code, "
        "environment and hosts are unknown"
    ) in lines
    assert "note: B has no plan.json: the plans are not compared" in lines
    assert not any(line.startswith(("code:", "environment:", "plan:")) for line in lines)


def test_a_missing_dir_or_a_dir_that_is_no_run_dir_is_one_line_and_exit_2(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = two_runs
    code, out, err = diff(a, tmp_path / "nowhere", cwd=tmp_path)
    assert (code, out) == (2, "")
    assert err.strip() == (
        f"pretrain diff: {tmp_path / 'nowhere'}: no such directory; expected a run dir; "
        "give the run.dir of a run `pretrain` wrote"
    )
    code, _, err = diff(tmp_path, a, cwd=tmp_path)
    assert code == 2 and f"{tmp_path}: no config.yaml; expected a run dir" in err
    code, _, err = diff(a, a, "--rtol", "-1", cwd=tmp_path)
    assert code == 2 and "'-1' is not a finite number >= 0" in err
    binary = Path(shutil.copytree(a, tmp_path / "binary"))
    (binary / LEDGER_FILE).write_bytes(b"\x00\xff")
    code, _, err = diff(a, binary, cwd=tmp_path)
    assert code == 2 and err.startswith(f"pretrain diff: {binary / LEDGER_FILE}: not UTF-8")


@pytest.mark.parametrize(
    ("value", "written"),
    [(0.003, "0.003"), (True, "true"), (None, "null"), ("bf16", "bf16"), ("1e-3", "'1e-3'"),
     ("true", "'true'"), ("a b", "'a b'"), ([1, "x"], "[1,x]"), ({}, "{}")],
)  # fmt: skip
def test_values_are_written_as_overrides_would_be(value: object, written: str) -> None:
    assert override_value(value) == written
