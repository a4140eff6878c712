"""Generated input for the override parser, the recipe reader and each file reader: every
example ends in a clean refusal (RecipeError or ReadError naming the field or file) or a
value, never another exception, never a hang (a deadline per example), nothing written.

Derandomized with a fixed example budget, so the run is the same every time and fast."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pretrain.core.inputs.reading import ReadError
from pretrain.core.problems import RecipeError
from pretrain.core.schema import load_config
from pretrain.launcher.compose.command_line import checked_command_line
from pretrain.launcher.compose.recipe_keys import leaf_types
from pretrain.launcher.job.diff import compare, render
from pretrain.launcher.job.run_record import read_run
from pretrain.launcher.job.status import run_status
from pretrain.launcher.report import load_metrics
from tests.helpers import tree

FUZZ = settings(
    max_examples=60,
    derandomize=True,
    deadline=3000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
"""A fixed budget, the same examples every run, and no example may take 3 s."""

KEYS = sorted(leaf_types())
VALUES = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["[", "]", "{a:1}", "[1,[2,[3]]]", "null", "${oc.env:HOME}", "1,2", "~"]),
)
OVERRIDES = st.one_of(
    st.text(max_size=60),
    st.tuples(st.sampled_from(["", "+", "~", "++"]), st.sampled_from(KEYS), VALUES).map(
        lambda t: f"{t[0]}{t[1]}={t[2]}"
    ),
    st.tuples(st.sampled_from(["hydra.", "hydra/", "model@", ""]), st.text(max_size=20)).map(
        lambda t: f"{t[0]}{t[1]}=x"
    ),
)


def refused_cleanly(error: Exception) -> None:
    """A refusal names what is at fault: a field (Problem) or a file (ReadError)."""
    if isinstance(error, RecipeError):
        assert error.problems and all(p.field for p in error.problems)
    else:
        assert isinstance(error, ReadError) and error.source, repr(error)


@FUZZ
@given(arguments=st.lists(OVERRIDES, max_size=4), multirun=st.booleans())
def test_the_command_line_check_refuses_or_accepts(arguments: list[str], multirun: bool) -> None:
    argv = (["-m"] if multirun else []) + arguments
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            checked = checked_command_line(argv, "tiny")
    except (RecipeError, ReadError) as error:
        refused_cleanly(error)
    except SystemExit as stop:  # Hydra's argument parser: an unknown --flag is exit 2
        assert stop.code == 2
    else:
        assert checked[: len(argv)] == argv


YAMLISH = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300).map(str.encode),
    st.lists(
        st.tuples(
            st.sampled_from(["", "  ", "    "]),
            st.sampled_from([*KEYS[:40], "defaults", "hydra", "model", "train", "- x", "&a", "*a"]),
            VALUES,
        ),
        max_size=8,
    ).map(lambda rows: "".join(f"{i}{k}: {v}\n" for i, k, v in rows).encode()),
)
HEADERS = st.sampled_from([b"", b"# @package hydra\n", b"# @package _global_\n", b"# @x y\n"])


@FUZZ
@given(header=HEADERS, content=YAMLISH, group=st.sampled_from(["", "model/", "evil/"]))
def test_a_recipe_file_is_refused_or_accepted(
    tmp_path_factory: pytest.TempPathFactory, header: bytes, content: bytes, group: str
) -> None:
    root = tmp_path_factory.mktemp("recipe")
    (root / "main.yaml").write_text("defaults:\n  - tiny\n  - _self_\n")
    (root / group).mkdir(exist_ok=True)
    (root / group / "fuzz.yaml").write_bytes(header + content)
    before = tree(root)
    try:
        checked_command_line(["--config-dir", str(root), "--config-name", "main"], "tiny")
    except (RecipeError, ReadError) as error:
        refused_cleanly(error)
    assert tree(root) == before


RUN_FILES = st.one_of(
    st.binary(max_size=400),
    st.lists(
        st.dictionaries(
            st.sampled_from(["step", "loss", "val_loss", "tokens_per_s", "step_time_s", "mfu"]),
            st.one_of(
                st.none(),
                st.booleans(),
                st.text(max_size=5),
                st.integers(),
                st.floats(allow_nan=True, allow_infinity=True),
                st.lists(st.integers(), max_size=2),
            ),
            max_size=4,
        ).map(repr),
        max_size=5,
    ).map(lambda rows: "\n".join(r.replace("'", '"').replace("None", "null") for r in rows)),
)


@FUZZ
@given(config=st.one_of(YAMLISH, st.just(b"name: tiny\ntrain:\n  steps: 10\n")), metrics=RUN_FILES)
def test_a_run_dirs_files_are_refused_or_read(
    tmp_path_factory: pytest.TempPathFactory, config: bytes, metrics: bytes | str
) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.yaml").write_bytes(config)
    metrics_bytes = metrics if isinstance(metrics, bytes) else metrics.encode()
    for name in ("metrics.jsonl", "ledger.jsonl", "plan.json"):  # JSON lines, or not
        (run_dir / name).write_bytes(metrics_bytes)
    before = tree(run_dir)
    for read in (
        run_status,
        lambda d: load_metrics(d / "metrics.jsonl"),
        lambda d: render(compare(read_run(d), read_run(d))),
    ):
        try:
            read(run_dir)
        except (RecipeError, ReadError) as error:
            refused_cleanly(error)
    try:
        load_config(str(run_dir / "config.yaml"))
    except ReadError as error:
        refused_cleanly(error)
    assert tree(run_dir) == before
