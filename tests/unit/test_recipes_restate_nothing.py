"""Recipes restate nothing: every value in a file under recipes/ changes what a recipe
composes to, against the schema's defaults (core/schema.py, model_config.py) and,
in a recipe file, against the group files its defaults list composes before it."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from pretrain.core.schema import RecipeConfig
from pretrain.launcher.compose.recipe_files import HYDRA_SETTINGS_FILE, load, package_of, yaml_files
from tests.helpers import REPO

MODEL_SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len")
PLACEHOLDERS = frozenset({"name", *(f"model.{field}" for field in MODEL_SHAPE)})
"""Fields whose schema default is a placeholder each recipe (the name) or model file (the
shape) must set, so stating a value equal to it restates nothing."""


def schema_defaults(node: Any = None, prefix: str = "") -> dict[str, Any]:
    """(dotted field, default) of every leaf field of the recipe schema; dict and list
    fields stay whole."""
    node = RecipeConfig() if node is None else node
    found: dict[str, Any] = {}
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            found.update(schema_defaults(value, f"{prefix}{f.name}."))
        else:
            found[f"{prefix}{f.name}"] = value
    return found


def leaves(node: dict, prefix: str, known: dict[str, Any]) -> list[tuple[str, Any]]:
    """(dotted field, value) of every field a recipe file sets; a dict field stays whole."""
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in known:
            found += leaves(value, f"{path}.", known)
        else:
            found.append((path, value))
    return found


def file_leaves(path: Path, config_dir: Path, known: dict[str, Any]) -> list[tuple[str, Any]]:
    """The fields a group or recipe file sets, with its section's prefix (defaults aside)."""
    content, problems = load(path)
    assert problems == [], problems
    section = package_of(path, config_dir)
    body = {k: v for k, v in content.items() if k not in ("defaults", "hydra")}
    return leaves(body, f"{section}." if section else "", known)


def values_before(path: Path, config_dir: Path, known: dict[str, Any]) -> dict[str, list]:
    """(value, where it comes from) of each field before a recipe file's own lines: first
    what its defaults list composes (the schema's default, overridden by the group files
    before _self_), then what each other option of those groups would give instead, since
    the recipe's line decides the field whichever option the command line picks."""
    before = {key: [(value, "the schema's default")] for key, value in known.items()}
    content, _ = load(path)
    for entry in content.get("defaults") or []:
        if entry == "_self_":
            break
        for group, option in entry.items() if isinstance(entry, dict) else ():
            folder = config_dir / str(group).lstrip("/")
            chosen = folder / f"{option}.yaml"
            if not chosen.is_file():
                continue
            sets = dict(file_leaves(chosen, config_dir, known))
            for key, value in sets.items():
                before[key] = [(value, chosen.relative_to(config_dir.parent).as_posix())]
            for other in sorted(folder.glob("*.yaml")):
                other_sets = dict(file_leaves(other, config_dir, known))
                where = other.relative_to(config_dir.parent).as_posix()
                for key in {*sets, *other_sets} & known.keys():
                    before[key].append((other_sets.get(key, known[key]), where))
    return before


def restatements(config_dir: Path) -> list[str]:
    """`FILE: field=value restates WHAT` for every value that equals what the field would be
    without that line."""
    known = schema_defaults()
    schema = {key: [(value, "the schema's default")] for key, value in known.items()}
    found = []
    for path in yaml_files(config_dir):
        if path.relative_to(config_dir).as_posix() == HYDRA_SETTINGS_FILE:
            continue
        top = path.parent == config_dir
        before = values_before(path, config_dir, known) if top else schema
        for key, value in file_leaves(path, config_dir, known):
            if key in PLACEHOLDERS or key not in before:
                continue
            if all(same(value, previous) for previous, _ in before[key]):
                where = path.relative_to(config_dir.parent).as_posix()
                found.append(f"{where}: {key}={value!r} restates {before[key][0][1]}")
    return found


def same(value: Any, previous: Any) -> bool:
    """Whether a recipe's value is the one the field already has (1 is not True)."""
    return bool(value == previous) and isinstance(value, bool) == isinstance(previous, bool)


def test_no_shipped_recipe_or_group_file_restates_a_value() -> None:
    assert restatements(REPO / "recipes") == []


def test_a_value_is_restated_only_if_it_is_the_one_every_option_of_its_group_gives(
    tmp_path: Path,
) -> None:
    recipes = tmp_path / "recipes"
    (recipes / "parallel").mkdir(parents=True)
    (recipes / "model").mkdir()
    (recipes / "parallel" / "deep.yaml").write_text("pp: 4\nzero: 0\nsp: true\n")
    (recipes / "parallel" / "flat.yaml").write_text("sp: false\n")
    (recipes / "model" / "small.yaml").write_text("dim: 128\nnorm_eps: 1.0e-5\n")
    (recipes / "mine.yaml").write_text(
        "defaults:\n  - recipe_schema\n  - parallel: deep\n  - model: small\n  - _self_\n"
        "name: tiny\nseed: 7\nparallel:\n  pp: 1\n  zero: 0\n  sp: true\n"
        "train:\n  seq_len: 128\n  steps: 600\n"
    )

    assert restatements(recipes) == [
        "recipes/mine.yaml: parallel.zero=0 restates recipes/parallel/deep.yaml",
        "recipes/mine.yaml: train.seq_len=128 restates the schema's default",
        "recipes/model/small.yaml: model.norm_eps=1e-05 restates the schema's default",
        "recipes/parallel/deep.yaml: parallel.zero=0 restates the schema's default",
        "recipes/parallel/flat.yaml: parallel.sp=False restates the schema's default",
    ]
