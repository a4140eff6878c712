"""Optimizer numerics and local data paths are checked before a job starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.core.problems import RecipeError
from pretrain.launcher.validate.recipe import validate
from tests.helpers import configure


def problem_fields(overrides: dict, for_launch: bool) -> dict[str, str]:
    try:
        validate(configure(overrides), for_launch=for_launch)
    except RecipeError as err:
        return {p.field: str(p) for p in err.problems}
    return {}


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"optim.eps": 0.0}, "optim.eps", "optim.eps=0.0"),
        ({"optim.momentum": 1.0}, "optim.momentum", "must lie in [0, 1)"),
        ({"optim.momentum": -0.1}, "optim.momentum", "must lie in [0, 1)"),
    ],
)
def test_bad_optimizer_numerics_are_refused(overrides, field, reason):
    assert reason in problem_fields(overrides, for_launch=False)[field]


def test_a_missing_local_corpus_is_refused_for_a_local_launch(tmp_path: Path):
    missing = str(tmp_path / "nowhere" / "*.jsonl")
    problems = problem_fields({"data.source": missing}, for_launch=True)
    assert "no such file or directory, and no glob match" in problems["data.source"]
    # Planning does not need the data.
    assert "data.source" not in problem_fields({"data.source": missing}, for_launch=False)


def test_an_existing_local_corpus_and_glob_are_accepted(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    for source in (str(tmp_path / "a.jsonl"), str(tmp_path), str(tmp_path / "*.jsonl")):
        assert "data.source" not in problem_fields({"data.source": source}, for_launch=True)


def test_a_missing_tokenizer_is_refused_for_a_local_launch(tmp_path: Path):
    problems = problem_fields({"data.tokenizer": str(tmp_path / "tok.json")}, for_launch=True)
    assert "no such tokenizer.json or tokenizer directory" in problems["data.tokenizer"]


def test_paths_are_not_checked_on_the_login_node_of_a_slurm_job(tmp_path: Path):
    overrides = {
        "data.source": str(tmp_path / "missing.txt"),
        "data.tokenizer": str(tmp_path / "tok.json"),
        "cluster.backend": "slurm",
    }
    problems = problem_fields(overrides, for_launch=True)
    assert "data.source" not in problems and "data.tokenizer" not in problems
