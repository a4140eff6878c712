"""The command line and recipe files are checked before Hydra: every problem at once, in the
validator's `field=value: reason; fix` form; Hydra's own errors are translated the same way."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ValidationError

from pretrain.core.inputs.reading import YAML_MAX_ALIASES as MAX_ALIASES
from pretrain.core.problems import RecipeError
from pretrain.launcher.compose.command_line import (
    QUIET_HYDRA,
    checked_command_line,
    flags_first,
    translate,
)
from pretrain.launcher.compose.recipe_files import load, package_of
from pretrain.launcher.compose.recipe_keys import did_you_mean, value_problem


def problems_of(*argv: str) -> list[str]:
    with pytest.raises(RecipeError) as error:
        checked_command_line(list(argv), "tiny")
    return [str(p) for p in error.value.problems]


def test_a_sound_command_line_gets_the_launchers_quiet_hydra_settings() -> None:
    argv = ["train.steps=5", "precision=bf16", "+cluster.env.NCCL_DEBUG=INFO"]
    assert checked_command_line(argv, "tiny") == [*argv, *QUIET_HYDRA]


def test_every_bad_override_is_reported_at_once() -> None:
    found = problems_of("parallel.tpp=2", "train.steps=many", "precision=bf61", "+foo=1")
    assert found == [
        "parallel.tpp=2: no such key in the recipe schema; did you mean parallel.tp, "
        "parallel.pp or parallel.vpp?",
        "train.steps=many: not a whole number; give a whole number",
        "precision=bf61: no such option; did you mean bf16? use bf16, fp16, fp32, fp8 or fp8_te",
        "foo=1: no such key in the recipe schema; a recipe has name, action, seed, model, "
        "parallel, precision, recompute, compile, optim, schedule, train, data, eval, init, "
        "cluster, hardware, logging, checkpoint, faults, run, plan, suggest, dryrun, calibrate "
        "(see core/schema.py)",
    ]


def test_a_mixture_of_sources_is_checked_entry_by_entry() -> None:
    sound = ["data.sources=[{source:/x,weight:3},{source:/y,weight:1,name:b}]"]
    assert checked_command_line(sound, "tiny") == [*sound, *QUIET_HYDRA]
    [found] = problems_of("data.sources=[{sourc:/x}]")
    assert found.startswith("data.sources=") and "a list of mappings with source, weight" in found


def test_plus_of_an_unknown_key_is_an_error_and_of_a_known_one_says_drop_the_plus() -> None:
    assert problems_of("+parallel.tpp=2")[0].startswith("parallel.tpp=2: no such key")
    assert problems_of("+parallel.tp=2") == [
        "+parallel.tp=2: parallel.tp is in the schema already, so '+' would add it a second "
        "time; drop the '+': parallel.tp=2"
    ]


def test_an_unknown_recipe_lists_the_recipes() -> None:
    [found] = problems_of("--config-name", "tyni")
    assert found.startswith("--config-name=tyni: no such recipe; did you mean tiny? use ")
    assert "llama3_8b" in found and "base" not in found.split("use ")[1]


def test_hydra_settings_are_refused_from_the_command_line() -> None:
    found = problems_of("+hydra.callbacks.x._target_=builtins.open", "hydra/launcher=basic")
    assert [p.split("=")[0] for p in found] == ["hydra.callbacks.x._target_", "hydra/launcher"]
    assert all("can run code or write files" in p for p in found)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("train.steps", 1e12, "not a whole number"),
        ("optim.betas", [0.9, "x"], "not a list of numbers"),
        ("cluster.env", 5, "not a mapping of names to strings"),
        ("logging.all_ranks", "maybe", "not true or false"),
        ("train.steps", 5, None),
        ("optim.lr", 3, None),
        ("cluster.env.NCCL_DEBUG", "INFO", None),
        ("train.steps", "${oc.env:STEPS}", None),
    ],
)
def test_values_are_checked_against_the_fields_type(path, value, expected) -> None:
    problem = value_problem(path, value)
    assert (problem and problem.reason) == expected


def test_a_typo_gets_the_closest_fields_of_its_section() -> None:
    assert did_you_mean("parallel.tpp") == "did you mean parallel.tp, parallel.pp or parallel.vpp?"
    assert did_you_mean("trian.steps") == "did you mean train.steps or optim.eps?"


def test_an_alias_bomb_is_refused_from_the_parser_events_without_expanding(tmp_path) -> None:
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcde", "bcdef", strict=True):
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(rows) + "\n")
    start = time.perf_counter()
    content, [problem] = load(bomb)
    assert time.perf_counter() - start < 1.0
    assert content is None
    assert problem.reason == f"more than {MAX_ALIASES} YAML anchors and aliases"


def test_a_few_anchors_are_fine(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim: &o {lr: 0.1}\nschedule: {warmup_steps: 2}\n")
    assert load(recipe) == ({"optim": {"lr": 0.1}, "schedule": {"warmup_steps": 2}}, [])


def test_a_group_file_lands_in_its_section_unless_its_header_says_otherwise(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    plain, glob = tmp_path / "model" / "m.yaml", tmp_path / "model" / "g.yaml"
    plain.write_text("dim: 64\n")
    glob.write_text("# @package _global_\nmodel: {dim: 64}\n")
    assert package_of(plain, tmp_path) == "model"
    assert package_of(glob, tmp_path) == ""
    assert package_of(tmp_path / "model" / "m.yaml", tmp_path / "model") == ""


def test_hydra_errors_are_translated_into_problems() -> None:
    missing = MissingConfigException(
        "Could not find 'precision/bf61'", missing_cfg_file="precision/bf61",
        options=["bf16", "fp32"],
    )  # fmt: skip
    assert [str(p) for p in translate(missing)] == [
        "precision=bf61: no such option; did you mean bf16? use bf16 or fp32"
    ]
    cause = ValidationError("Value 'x' could not be converted to Integer")
    cause.full_key, cause.value = "train.steps", "x"
    composed = ConfigCompositionException("Error merging override train.steps=x")
    composed.__cause__ = cause
    [problem] = translate(composed)
    assert (problem.field, problem.value) == ("train.steps", "x")
    assert "could not be converted to Integer" in problem.reason
    assert translate(KeyError("not Hydra's")) is None


def test_a_plus_of_an_entry_the_recipe_sets_names_the_value_given(monkeypatch) -> None:
    """A dict entry the recipe sets (not a schema field, which the launcher checks first)
    reaches Hydra, whose message names the key alone: the value comes from the command line."""
    key = "logging.stability_alerts.grad_norm_max"
    monkeypatch.setattr(sys, "argv", ["pretrain", f"+{key}=3"])
    error = ConfigCompositionException(f"Could not append to config. An item is already at '{key}'")
    [problem] = translate(error)
    assert str(problem) == (
        f"+{key}=3: {key} is set already (by the recipe, or by an earlier +{key}); give it "
        f"once; without '+' to change it: {key}=3"
    )


def test_the_launchers_hydra_settings_file_is_the_only_one_allowed(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - recipe_schema\n  - _self_\nhydra:\n  run:\n    dir: /elsewhere\n"
    )
    found = problems_of("--config-dir", str(tmp_path), "--config-name", "mine")
    assert found == [
        f"hydra.run.dir=/elsewhere: in {tmp_path / 'mine.yaml'}: Hydra's own settings "
        "(callbacks, launchers, sweepers, search path, output and logging) can run code or "
        "write files outside the run dir, so recipes and the command line may not set them; "
        "remove it; the launcher's Hydra settings live in recipes/base.yaml (a sweep may "
        "choose its sweeper: hydra/sweeper=optuna, see docs/sweeps.md)"
    ]


def test_a_sweep_may_choose_the_optuna_sweeper_and_its_allowed_settings_by_name() -> None:
    argv = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra/sweeper/sampler=tpe",
            "hydra.sweeper.sampler.seed=3", "hydra.sweeper.direction=minimize",
            "optim.lr=interval(1e-4,1e-2)"]  # fmt: skip
    assert checked_command_line(argv, "tiny") == [*argv, *QUIET_HYDRA]


def test_the_rest_of_the_sweepers_settings_stay_refused() -> None:
    found = problems_of(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.storage=sqlite:///x.db",
        "hydra.sweeper.custom_search_space=os.system", "hydra/launcher=joblib",
    )  # fmt: skip
    assert [p.split(":")[0] for p in found] == [
        "hydra.sweeper.storage=sqlite", "hydra.sweeper.custom_search_space=os.system",
        "hydra/launcher=joblib",
    ]  # fmt: skip


def test_bad_sweeper_values_are_refused_with_what_fits() -> None:
    found = problems_of(
        "-m", "hydra/sweeper=optina", "hydra.sweeper.n_trials=0", "hydra.sweeper.direction=up"
    )
    assert found == [
        "hydra/sweeper=optina: no such option; did you mean optuna? use basic or optuna",
        "hydra.sweeper.n_trials=0: must be at least 1; use 1 or more",
        "hydra.sweeper.direction=up: no such option; use minimize or maximize",
    ]


def test_a_sweeper_outside_a_sweep_is_refused() -> None:
    [found] = problems_of("hydra/sweeper=optuna")
    assert found == "hydra/sweeper=optuna: a sweeper setting only matters in a sweep; add -m"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["parallel.tp=2", "--config-name", "x", "action=plan"],
         ["--config-name", "x", "parallel.tp=2", "action=plan"]),
        (["a=1", "-m", "b=1,2", "--config-dir=d", "c=3"],
         ["-m", "--config-dir=d", "a=1", "b=1,2", "c=3"]),
        (["a=1", "--info", "b=2"], ["--info", "a=1", "b=2"]),
        (["a=1", "--info", "defaults"], ["--info", "defaults", "a=1"]),
        (["--help", "cluster"], ["--help", "cluster"]),
        (["a=1", "--config-name"], ["a=1", "--config-name"]),
    ],
)  # fmt: skip
def test_flags_move_before_the_overrides_with_their_values(
    argv: list[str], expected: list[str]
) -> None:
    assert flags_first(argv) == expected


def test_a_sweep_listing_a_value_twice_is_refused_before_any_point_runs() -> None:
    assert problems_of("-m", "seed=1,1,2", "precision=fp32,bf16,fp32") == [
        "seed='1,1,2': sweeps 1 twice: two points with one run dir; list each value once: seed=1,2",
        "precision='fp32,bf16,fp32': sweeps fp32 twice: two points with one run dir; list "
        "each value once: precision=fp32,bf16",
    ]
    sound = ["-m", "seed=1,2"]
    assert checked_command_line(sound, "tiny") == [*sound, *QUIET_HYDRA]
