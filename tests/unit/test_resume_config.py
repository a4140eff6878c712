"""A run dir accepts a new layout or length for a resumed run, never a change of what it
trains, and keeps every config it was trained under."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.job.run_dir import JobError, write_run_dir
from pretrain.launcher.validate.resume import changed_fields, frozen_changes


def _yaml(**changes: object) -> str:
    cfg = RecipeConfig()
    for dotted, value in changes.items():
        section, field = dotted.split("__")
        setattr(getattr(cfg, section), field, value)
    return dump_config(cfg)


def test_a_layout_that_regroups_a_node_limited_router_is_refused() -> None:
    limited = {"model__moe_experts": 8, "model__moe_node_limit": 1, "parallel__ep": 8}
    old = _yaml(**limited, cluster__gpus_per_node=4)
    assert frozen_changes(old, _yaml(**limited, cluster__gpus_per_node=4, parallel__zero=3)) == []
    assert frozen_changes(old, _yaml(**limited, cluster__gpus_per_node=8)) == [
        "the nodes the ep group spans under model.moe_node_limit (2 -> 1: the router's expert "
        "groups)"
    ]


def test_changed_fields_are_named_with_dots() -> None:
    assert changed_fields(_yaml(), _yaml(parallel__zero=3, train__steps=7)) == [
        "parallel.zero",
        "train.steps",
    ]


def test_layout_and_length_may_change_but_not_what_is_trained() -> None:
    resumable = _yaml(parallel__zero=3, parallel__dp_shard=1, train__steps=900, checkpoint__every=5)
    assert frozen_changes(_yaml(), resumable) == []
    frozen = _yaml(parallel__zero=3, optim__lr=1.0, train__global_batch=32)
    assert frozen_changes(_yaml(), frozen) == ["optim.lr", "train.global_batch"]


def test_a_new_layout_replaces_config_yaml_and_keeps_the_old_one(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    first, second = _yaml(), _yaml(parallel__zero=3)
    files = write_run_dir(cfg, tmp_path / "run", first)
    write_run_dir(cfg, tmp_path / "run", second)
    assert files.config_path.read_text() == second
    assert (tmp_path / "run" / "config.1.yaml").read_text() == first


def test_a_change_of_model_is_refused_and_names_the_field(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    files = write_run_dir(cfg, tmp_path / "run", _yaml())
    with pytest.raises(JobError, match=r"not model\.dim\. Pick a new run\.dir"):
        write_run_dir(cfg, tmp_path / "run", _yaml(model__dim=256, parallel__zero=3))
    assert files.config_path.read_text() == _yaml()
    assert not (tmp_path / "run" / "config.1.yaml").exists()
