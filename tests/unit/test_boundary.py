"""The error boundary every entry point runs its body through: how each kind of ending
reaches the console (one line) and the exit code."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.core.inputs.boundary import TRACEBACK_DIR, run_command
from pretrain.core.inputs.reading import ReadError
from pretrain.core.problems import Problem, RecipeError


class OwnError(Exception):
    pass


def ended(body, capsys, user_errors=()) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        run_command("cmd", body, user_errors)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return stop.value.code, captured.err


def raising(error: BaseException):
    def body() -> None:
        raise error

    return body


def test_each_ending_has_its_code_and_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert ended(lambda: None, capsys) == (0, "")
    assert ended(lambda: 3, capsys) == (3, "")
    code, err = ended(raising(KeyboardInterrupt()), capsys)
    assert code == 130 and err.strip() == "cmd: interrupted (Ctrl-C); stopped"
    code, err = ended(raising(ReadError("/x/y.json", "binary", "a lock", "fix it")), capsys)
    assert code == 2 and err == "cmd: /x/y.json: binary; expected a lock; fix it\n"
    code, err = ended(raising(RecipeError([Problem("a.b", 1, "why", "fix")])), capsys)
    assert code == 2 and "a.b=1" in err
    code, err = ended(raising(FileNotFoundError(2, "No such file", "/nowhere")), capsys)
    assert code == 2 and err.startswith("cmd: /nowhere: No such file") and err[-1] == "\n"
    code, err = ended(raising(ConnectionError("Couldn't reach 'x' on the Hub")), capsys)
    assert code == 2 and "check the network" in err
    code, err = ended(raising(OwnError("mine")), capsys, (OwnError,))
    assert (code, err) == (2, "cmd: mine\n")
    assert not (tmp_path / TRACEBACK_DIR).exists()  # no user error saves a traceback


def test_a_bug_saves_its_traceback_and_says_where(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    code, err = ended(raising(ZeroDivisionError("division by zero")), capsys)
    [saved] = (tmp_path / TRACEBACK_DIR).iterdir()
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"ZeroDivisionError: division by zero; its traceback is in {saved}" in err
    assert "Traceback (most recent call last)" in saved.read_text()
    # An OSError that names no file is no user's path: a bug too.
    code, _ = ended(raising(OSError("no file here")), capsys)
    assert code == 1


def test_a_bug_whose_traceback_cannot_be_saved_still_ends_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "file"))  # not a folder
    code, err = ended(raising(ValueError("x")), capsys)
    assert code == 1 and "could not be saved" in err and len(err.strip().splitlines()) == 1
