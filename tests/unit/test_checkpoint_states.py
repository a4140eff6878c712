"""The checkpointer saves and restores a map of objects that keep their own state, each in
its format (DCP shards, meta.json, a file per rank), and knows nothing else of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pretrain.core.schema import CheckpointConfig
from pretrain.trainer.checkpoint.checkpointer import Checkpointer, States


class Tensors:
    """A Stateful of named tensors, filled in place by a load."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tensors = dict(state_dict)


class Value:
    """A Stateful of one JSON value, which counts the loads it was told of nothing."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.absent = 0

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value

    def load_absent(self) -> None:
        self.absent += 1


class Renamed(Tensors):
    """Saves `a` but loads it from the checkpoint's `b`."""

    def state_dict_for_load(self) -> dict[str, Any]:
        return {"b": self.tensors["a"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tensors = {"a": state_dict["b"]}


def checkpointer(run_dir: Path, states: States) -> Checkpointer:
    return Checkpointer(run_dir, CheckpointConfig(every=2), states, rank=0, world_size=1)


def test_each_object_is_saved_under_its_name_in_its_format_and_restored(
    tmp_path: Path, single_rank_group
) -> None:
    saved = States(
        sharded={"model": Tensors(w=torch.arange(4.0))},
        replicated={"data": Value({"step": 4}), "run_id": Value("abc")},
        per_rank={"rng": Tensors(cpu=torch.tensor([7]))},
    )
    checkpointer(tmp_path, saved).save(4)
    step = tmp_path / "checkpoints" / "step_00000004"
    meta = json.loads((step / "meta.json").read_text())
    assert meta == {"step": 4, "world_size": 1, "data": {"step": 4}, "run_id": "abc"}
    assert (step / "rng" / "rank_0.pt").is_file()
    manifest = json.loads((step / "manifest.json").read_text())
    assert "rng/rank_0.pt" in json.dumps(manifest)

    fresh = States(
        sharded={"model": Tensors(w=torch.zeros(4))},
        replicated={"data": Value(None), "run_id": Value(None)},
        per_rank={"rng": Tensors(cpu=torch.tensor([0]))},
    )
    assert checkpointer(tmp_path, fresh).restore() == 4
    assert torch.equal(fresh.sharded["model"].tensors["w"], torch.arange(4.0))
    assert fresh.replicated["data"].value == {"step": 4}
    assert fresh.replicated["run_id"].value == "abc"
    assert torch.equal(fresh.per_rank["rng"].tensors["cpu"], torch.tensor([7]))


def test_an_object_the_checkpoint_lacks_keeps_its_state_or_is_told(
    tmp_path: Path, single_rank_group
) -> None:
    checkpointer(tmp_path, States({"model": Tensors(w=torch.ones(2))}, {}, {})).save(2)
    stash, scaler = Tensors(w=torch.zeros(2)), Value({"scale": 1.0})
    told = Value("kept")
    later = States(
        sharded={"model": Tensors(w=torch.zeros(2)), "stash": stash},
        replicated={"loss_scaler": scaler, "told": told},
        per_rank={},
    )
    assert checkpointer(tmp_path, later).restore() == 2
    assert torch.equal(later.sharded["model"].tensors["w"], torch.ones(2))
    assert torch.equal(stash.tensors["w"], torch.zeros(2))
    assert (scaler.value, scaler.absent) == ({"scale": 1.0}, 1)
    assert (told.value, told.absent) == ("kept", 1)


def test_an_object_may_load_from_other_names_than_it_saves(
    tmp_path: Path, single_rank_group
) -> None:
    saved = Tensors(a=torch.zeros(3), b=torch.arange(3.0))
    checkpointer(tmp_path, States({"model": saved}, {}, {})).save(2)
    renamed = Renamed(a=torch.zeros(3))
    assert checkpointer(tmp_path, States({"model": renamed}, {}, {})).restore() == 2
    assert torch.equal(renamed.tensors["a"], torch.arange(3.0))


def test_a_save_first_settles_the_objects(tmp_path: Path, single_rank_group) -> None:
    model = Tensors(w=torch.zeros(2))
    settled = States({"model": model}, {}, {}, settle=lambda: model.tensors["w"].fill_(5.0))
    checkpointer(tmp_path, settled).save(2)
    fresh = Tensors(w=torch.zeros(2))
    checkpointer(tmp_path, States({"model": fresh}, {}, {})).restore()
    assert torch.equal(fresh.tensors["w"], torch.full((2,), 5.0))
