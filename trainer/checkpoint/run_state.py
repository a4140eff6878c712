"""What a training run's checkpoint holds, by name: each component's own Stateful, in the
format the checkpointer keeps it in (these names are the checkpoint's keys on disk).

- sharded (DCP): `model` (the newest weights), `optim`, and under PipeDream-2BW `stash`
  (the older weight version);
- replicated (meta.json): `data` (the loader's position, layout-independent), `scheduler`,
  `loss_scaler`, `wandb_run_id` and `spike_rule` (the losses its running median is over);
- per rank (`rng/rank_R.pt`): `rng`, this rank's random number generators.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pretrain.parallel.model_state import ModelState, StashState
from pretrain.trainer.checkpoint.checkpointer import States
from pretrain.trainer.data.loader import DataLoader
from pretrain.trainer.data.prefetch import PrefetchingLoader
from pretrain.trainer.faults.policies import SpikeRule
from pretrain.trainer.observe.loggers import WandbRunId
from pretrain.trainer.optim.checkpoint_state import OptimizerState
from pretrain.trainer.optim.lr_schedule import ScheduleState
from pretrain.trainer.step.state import TrainState


class RngState:
    """This rank's CPU (and, once initialized, CUDA) random number generators."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def run_states(
    state: TrainState,
    loader: DataLoader | PrefetchingLoader,
    run_dir: Path,
    is_main: bool,
    spikes: SpikeRule | None = None,
) -> States:
    """The checkpoint's map of `state` and `loader` (and the spike rule's window), read from
    `state` at each save and load (PipeDream-2BW swaps its weight versions between steps)."""

    def named_model() -> nn.Module:
        # Under pipeline parallelism the stage view: the chunks' own names would start with
        # their index.
        return state.plain if isinstance(state.model, nn.ModuleList) else state.model

    sharded: dict[str, Any] = {
        "model": ModelState(named_model),
        "optim": OptimizerState(state.optimizer, named_model, lambda: state.plain),
    }
    if state.stash is not None:
        sharded["stash"] = StashState(lambda: state.stash, named_model)
    replicated: dict[str, Any] = {
        "data": loader,
        "scheduler": ScheduleState(state.scheduler, state.optimizer),
        "loss_scaler": state.scaler,
        "wandb_run_id": WandbRunId(run_dir, is_main),
    }
    if spikes is not None:
        replicated["spike_rule"] = spikes
    return States(
        sharded=sharded,
        replicated=replicated,
        per_rank={"rng": RngState()},
        settle=lambda: state.settle() if state.settle is not None else None,
    )
