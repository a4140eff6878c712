"""The job script's extension points: the node's Python, the user's sbatch template, extra
#SBATCH lines, setup lines before torchrun, a container; each quoted, each validated."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from pretrain.core.schema import RecipeConfig
from pretrain.launcher.assets import SBATCH_TEMPLATE
from pretrain.launcher.job.run_dir import render_sbatch
from pretrain.launcher.validate.recipe import validate
from tests.helpers import configure, problems


def test_a_relative_cluster_python_is_refused_with_an_absolute_path_as_the_fix() -> None:
    [problem] = problems(configure({"cluster.python": "venv/bin/python"}))
    assert problem.field == "cluster.python" and problem.value == "venv/bin/python"
    assert "absolute path" in problem.fix


def test_a_cluster_python_with_a_line_break_is_refused() -> None:
    [problem] = problems(configure({"cluster.python": "python3\nrm -rf ~"}))
    assert problem.field == "cluster.python" and "line break" in problem.reason


def slurm(**cluster: object) -> RecipeConfig:
    cfg = configure({"cluster.backend": "slurm", **{f"cluster.{k}": v for k, v in cluster.items()}})
    return cfg


def test_extra_directives_setup_lines_and_a_container_are_rendered_quoted(tmp_path: Path) -> None:
    cfg = slurm(sbatch_extra=["--constraint=h100&nvlink", "--exclusive"],
                setup=["module load cuda/12.4", "source '/opt/my env/bin/activate'"])  # fmt: skip
    cfg.cluster.container.image = "nvcr.io/nvidia/pytorch:25.01-py3"
    cfg.cluster.container.mounts = ["/shared/data:/data:ro"]
    validate(cfg)
    script = render_sbatch(cfg, tmp_path, tmp_path / "config.yaml")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    header = script[: script.index("\nset -euo pipefail")]
    assert '#SBATCH --constraint="h100&nvlink"' in header.splitlines()
    assert "#SBATCH --exclusive" in header.splitlines()
    # What srun runs, as bash hands it over: pyxis options, then the node's script.
    srun = re.search(r"^ *srun (.*?) \|\| STATUS", script, flags=re.MULTILINE | re.DOTALL)[1]
    step = {**os.environ, "NODES": "2", "NODELIST": "node[1-2]", "STEP_OPTIONS": ""}
    words = subprocess.run(["bash", "-c", f"printf '%s\\0' {srun}"], capture_output=True,
                           text=True, check=True, env=step).stdout.split("\0")[:-1]  # fmt: skip
    assert words[5:8] == [
        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
        f"--container-mounts={tmp_path}:{tmp_path},/shared/data:/data:ro",
        f"--container-workdir={Path.cwd()}",
    ]
    node_script = words[-1]
    assert node_script.splitlines()[:2] == ['trap "" USR1; module load cuda/12.4',
                                            "source '/opt/my env/bin/activate'"]  # fmt: skip
    assert node_script.splitlines()[2].startswith("exec python3 -m pretrain.trainer.agent ")


def test_a_users_sbatch_template_is_rendered_instead_of_the_shipped_one(tmp_path: Path) -> None:
    mine = tmp_path / "mine.template"
    mine.write_text("#!/bin/bash\n# my site's preamble\n" + SBATCH_TEMPLATE.read_text())
    cfg = slurm(sbatch_template=str(mine))
    validate(cfg)
    assert "# my site's preamble" in render_sbatch(cfg, tmp_path, tmp_path / "config.yaml")


BAD_VALUES = [
    ({"sbatch_extra": ["--nodes=4"]}, "cluster.sbatch_extra[0]", "set cluster.nodes instead"),
    ({"sbatch_extra": ["constraint=h100"]}, "cluster.sbatch_extra[0]", "--name=value"),
    ({"sbatch_extra": ["--x=a\nrm -rf ~"]}, "cluster.sbatch_extra[0]", "on one line"),
    ({"setup": ["if true; then echo"]}, "cluster.setup", "fix the shell syntax"),
    ({"setup": ["a\nb"]}, "cluster.setup[0]", "split it"),
    ({"sbatch_template": "relative.template"}, "cluster.sbatch_template", "absolute path"),
    ({"sbatch_template": "/no/such.template"}, "cluster.sbatch_template", "absolute path"),
]


@pytest.mark.parametrize(("cluster", "field", "fix"), BAD_VALUES)
def test_a_bad_extension_value_is_refused_with_its_field_and_fix(
    cluster: dict, field: str, fix: str
) -> None:
    [problem] = problems(slurm(**cluster))
    assert problem.field == field and fix in problem.fix


def test_a_template_without_the_placeholders_is_refused_naming_them(tmp_path: Path) -> None:
    mine = tmp_path / "mine.template"
    mine.write_text(SBATCH_TEMPLATE.read_text().replace("${node_command}", "${my_command}"))
    [problem] = problems(slurm(sbatch_template=str(mine)))
    assert problem.reason == "lacks ${node_command}; has unknown ${my_command}"


def test_bad_container_images_and_mounts_are_refused() -> None:
    cfg = slurm()
    cfg.cluster.container.image = "my image"
    cfg.cluster.container.mounts = ["data:/data", "/a,/b:/c"]
    assert [p.field for p in problems(cfg)] == [
        "cluster.container.image", "cluster.container.mounts[0]", "cluster.container.mounts[1]",
    ]  # fmt: skip


def test_slurm_only_settings_on_a_local_run_are_refused_not_ignored() -> None:
    cfg = configure(
        {"cluster.setup": ["module load cuda"], "cluster.sbatch_extra": ["--exclusive"]}
    )
    assert [(p.field, p.fix) for p in problems(cfg)] == [
        ("cluster.sbatch_extra", "use cluster=slurm, or leave it unset for a local run"),
        ("cluster.setup", "use cluster=slurm, or leave it unset for a local run"),
    ]
