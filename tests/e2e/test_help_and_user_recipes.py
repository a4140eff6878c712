"""`pretrain --help` documents the recipes, actions and every field from the schema; the
user's own recipes come from --config-dir or PRETRAIN_RECIPES."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pretrain.core.field_docs import field_docs
from pretrain.core.schema import RecipeConfig
from tests.helpers import RECIPES, pretrain

pytestmark = pytest.mark.e2e

USER_RECIPE = "defaults:\n  - tiny\n  - _self_\n\nname: mine\ntrain:\n  steps: 3\n"


def test_every_schema_field_has_a_doc() -> None:
    undocumented = [f.path for f in field_docs(RecipeConfig) if not f.doc]
    assert undocumented == []


def test_help_lists_recipes_actions_and_every_field_with_its_doc(tmp_path: Path) -> None:
    result = pretrain("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    recipes = out[out.index("recipes (--config-name") : out.index("actions (")]
    assert all(name in recipes for name in RECIPES)
    for action in ("run", "plan", "script", "suggest", "prepare", "dryrun"):
        assert f"\n  {action} " in out
    assert re.search(r"^  precision +bf16, fp16, fp32, fp8, fp8_te$", out, flags=re.MULTILINE)
    lines = out.splitlines()
    for f in field_docs(RecipeConfig):
        [at] = [i for i, line in enumerate(lines) if line.startswith(f"  {f.path} = ")]
        assert " ".join(lines[at + 1].split()) in f.doc  # the doc follows its field
    assert list(tmp_path.iterdir()) == []


def test_help_with_a_section_lists_only_its_fields(tmp_path: Path) -> None:
    out = pretrain("--help", "cluster", cwd=tmp_path).stdout
    fields = re.findall(r"^  (\S+) = ", out, flags=re.MULTILINE)
    assert fields and all(f.startswith("cluster") for f in fields)
    assert "actions (action=NAME)" not in out


def test_a_user_recipe_is_found_through_pretrain_recipes_and_config_dir(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "mine.yaml").write_text(USER_RECIPE)
    for args, env in (((), {"PRETRAIN_RECIPES": str(mine)}), (("--config-dir", str(mine)), {})):
        result = pretrain(*args, "--config-name", "mine", "action=plan", "plan.format=json",
                          cwd=tmp_path, env=env)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["name"] == "mine"
    helped = pretrain("--help", cwd=tmp_path, env={"PRETRAIN_RECIPES": str(mine)}).stdout
    assert "mine" in helped[helped.index("recipes (--config-name") : helped.index("actions (")]


def test_a_missing_pretrain_recipes_directory_is_refused(tmp_path: Path) -> None:
    result = pretrain("action=plan", cwd=tmp_path, env={"PRETRAIN_RECIPES": "/no/such/dir"})
    assert result.returncode == 2
    assert "PRETRAIN_RECIPES=/no/such/dir: no such directory; give a directory of recipes" in (
        result.stderr
    )
