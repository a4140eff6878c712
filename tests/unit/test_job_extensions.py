"""The job script's extension points: the node's Python, the user's sbatch template, extra
#SBATCH lines, setup lines before torchrun, a container; each quoted, each validated."""

from __future__ import annotations

from tests.helpers import configure, problems


def test_a_relative_cluster_python_is_refused_with_an_absolute_path_as_the_fix() -> None:
    [problem] = problems(configure({"cluster.python": "venv/bin/python"}))
    assert problem.field == "cluster.python" and problem.value == "venv/bin/python"
    assert "absolute path" in problem.fix


def test_a_cluster_python_with_a_line_break_is_refused() -> None:
    [problem] = problems(configure({"cluster.python": "python3\nrm -rf ~"}))
    assert problem.field == "cluster.python" and "line break" in problem.reason
