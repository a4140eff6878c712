"""Sharded, atomic, resumable checkpoints under RUN_DIR/checkpoints.

A checkpoint of step N is the folder `step_N` (zero-padded). It is written as `step_N.tmp`
and renamed by rank 0 once every rank's shards, the DCP metadata, each rank's RNG state and
`meta.json` are on disk, so a crash during a save leaves only a `.tmp` folder that resume
never picks. Inside:

- DCP shards of `{"model": ..., "optim": ...}` keyed by the plain model's parameter names
  (pipeline stages included), so `torch.distributed.checkpoint` reshards them on load under
  any layout; vocabulary rows padded for another tp are fitted (`trainer/vocab_resize.py`);
  PipeDream-2BW adds `"stash"`, its older weight version (`model` is the newest), after
  draining its pipeline (`TrainState.settle`); a run without one resumes both versions from
  `model`;
- `meta.json`: step, the data loader's position (layout-independent: stored once), the LR
  scheduler's state, the W&B run id and the layout it was saved under;
- `rng/rank_R.pt`: the RNG states of rank R (restored only under the same world size).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.optim import ZeroRedundancyOptimizer

from parallel.tied_embedding import head_copies
from pretrain_core.rundir import CHECKPOINTS_DIR, WANDB_ID_FILE
from pretrain_core.schema import CheckpointConfig
from trainer.data import DataLoader
from trainer.fault_injection import FaultInjector
from trainer.step import TrainState
from trainer.vocab_resize import load_resizing_vocab

META = "meta.json"
STASH = "stash"
"""DCP key of PipeDream-2BW's older weight version."""
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d+)$")


EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"
"""The full model's names of a tied embedding and its LM head."""


def step_dir(root: Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first; `.tmp` folders never count."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META).is_file() and (path / DCP_METADATA).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(root: Path, step: int | None = None) -> Path | None:
    """The newest complete checkpoint (or the one of `step`), None if there is none."""
    found = complete_checkpoints(root)
    if step is not None:
        found = [(s, p) for s, p in found if s == step]
    return found[-1][1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a complete checkpoint."""
    return json.loads((path / META).read_text())


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _names(plain: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in plain.named_parameters()}


def _zero1_optim_state(optimizer: ZeroRedundancyOptimizer, plain: nn.Module) -> dict[str, Any]:
    """This rank's share of a ZeRO-1 optimizer, in the layout `get_state_dict` uses.

    Each rank holds the states of the parameters it owns; keyed by parameter name, the
    shares of all ranks are disjoint and together make the full optimizer state, which any
    layout can load (and a ZeRO-1 rank loads only the names it owns).
    """
    names = _names(plain)
    local = optimizer.optim
    state = {
        names[id(p)]: local.state[p]
        for group in local.param_groups
        for p in group["params"]
        if p in local.state
    }
    groups = []
    for global_group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
        hyper = {k: v for k, v in local_group.items() if k != "params"}
        hyper.update((k, v) for k, v in global_group.items() if k != "params")
        groups.append({**hyper, "params": [names[id(p)] for p in global_group["params"]]})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def _init_zero1_state(optimizer: ZeroRedundancyOptimizer) -> None:
    """Allocate this rank's optimizer states (a step with zero gradients and lr 0) so that
    DCP has tensors to load into; the loaded values replace them."""
    local = optimizer.optim
    if local.state:
        return
    lrs = [group["lr"] for group in local.param_groups]
    for group in local.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    local.step()
    for group, lr in zip(local.param_groups, lrs, strict=True):
        group["lr"] = lr
    local.zero_grad(set_to_none=True)


def _named_model(state: TrainState) -> nn.Module:
    """The module whose parameter names are the full model's: under pipeline parallelism
    the stage view (the stage chunks' own names would start with their index)."""
    return state.plain if isinstance(state.model, nn.ModuleList) else state.model


def read_tied_copy_from_embedding(
    model: nn.Module, model_sd: dict[str, Any], optim_state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The entries to load, a pipeline stage's copy of a tied embedding read from the
    embedding's (the same tensors, under the embedding's name): every checkpoint holds
    those, while one saved without PP keeps the shared weight's optimizer states under the
    embedding's name only."""
    if not head_copies(model) or EMBEDDING in model_sd:
        return model_sd, optim_state

    def renamed(entries: dict[str, Any]) -> dict[str, Any]:
        return {(EMBEDDING if key == HEAD else key): value for key, value in entries.items()}

    return renamed(model_sd), renamed(optim_state)


def _state_dicts(state: TrainState) -> dict[str, Any]:
    model = _named_model(state)
    if isinstance(state.optimizer, ZeroRedundancyOptimizer):
        return {
            "model": get_model_state_dict(model),
            "optim": _zero1_optim_state(state.optimizer, state.plain),
        }
    model_sd, optim_sd = get_state_dict(model, state.optimizer)
    saved = {"model": model_sd, "optim": optim_sd}
    if state.stash is not None:
        saved[STASH] = get_model_state_dict(state.stash)
    return saved


def _has_stash(path: Path) -> bool:
    """Whether the checkpoint at `path` holds a second weight version."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith(STASH + ".") for key in keys)


def _restore_stash(state: TrainState, path: Path) -> None:
    """Load the older weight version, or, from a checkpoint without one, the model's."""
    stash_sd = get_model_state_dict(state.stash)
    if _has_stash(path):
        load_resizing_vocab({STASH: stash_sd}, path)
    else:
        model_sd = get_model_state_dict(_named_model(state))
        load_resizing_vocab({"model": model_sd}, path)
        stash_sd = model_sd
    set_model_state_dict(state.stash, stash_sd)


def _scheduler_state(saved: dict[str, Any], groups: int) -> dict[str, Any]:
    """The LR scheduler's saved state for `groups` optimizer groups.

    How parameters split into groups depends on the layout (by DeviceMesh, and a pipeline
    stage holds only some parameters), while the schedule does not: every group has the
    same peak lr, so a saved group's entries stand for any group.
    """
    per_group = ("base_lrs", "_last_lr", "lr_lambdas")
    if len(saved["base_lrs"]) == groups:
        return saved
    for key in per_group:
        if key in saved and any(v != saved[key][0] for v in saved[key]):
            raise ValueError(
                f"the checkpoint's LR schedule differs between its {len(saved['base_lrs'])} "
                f"parameter groups ({key}={saved[key]}); it cannot be spread over {groups}"
            )
    return {**saved, **{k: [saved[k][0]] * groups for k in per_group if k in saved}}


@dataclass
class _Pending:
    """A save whose shards may still be in flight (async) and that rank 0 will finalize."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    future: Future | None


class Checkpointer:
    """Saves and restores one run's checkpoints; every rank makes the same calls."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        faults: FaultInjector | None = None,
    ):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.saved_step = 0
        """The step of the newest checkpoint written or restored."""
        self._pending: _Pending | None = None
        # Background saves run collectives while training runs its own: give them a group.
        self._group = dist.new_group(backend="gloo") if cfg.async_mode != "none" else None

    def due(self, step: int) -> bool:
        """Whether `step` (optimizer steps done) is a periodic save point."""
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def after_step(self, step: int, state: TrainState, loader: DataLoader, stop: bool) -> None:
        """Finalize a finished background save, and save `step` when it is a periodic save
        point or the job was asked to stop; collective."""
        self.poll()
        if self.due(step) or stop:
            self.save(step, state, loader)

    def finish(self, step: int, state: TrainState, loader: DataLoader) -> None:
        """Save the final `step` unless it already was, and wait until it is on disk."""
        if self.saved_step != step:
            self.save(step, state, loader)
        self.wait()

    def save(self, step: int, state: TrainState, loader: DataLoader) -> None:
        """Write the checkpoint of `step` (asynchronously if configured); collective."""
        self.wait()
        if state.settle is not None:
            state.settle()
        tmp = step_dir(self.root, step).with_name(step_dir(self.root, step).name + ".tmp")
        if self.rank == 0:
            # A previous attempt at this step that crashed mid-save: ours to clear.
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(_rng_state(), tmp / "rng" / f"rank_{self.rank}.pt")
        wandb_id = self.root.parent / WANDB_ID_FILE
        full_meta = {
            "step": step,
            "wandb_run_id": wandb_id.read_text().strip() if wandb_id.is_file() else None,
            "world_size": self.world_size,
            "data": loader.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "loss_scaler": state.scaler.state_dict(),
        }
        state_dict = _state_dicts(state)
        future = None
        if self.cfg.async_mode == "none":
            dcp.save(state_dict, checkpoint_id=str(tmp))
        else:
            kind = AsyncCheckpointerType(self.cfg.async_mode)
            future = dcp.async_save(
                state_dict,
                checkpoint_id=str(tmp),
                process_group=self._group,
                async_checkpointer_type=kind,
            )
        self._pending = _Pending(step, tmp, full_meta, future)
        self.saved_step = step
        if future is None:
            self.wait()

    def poll(self) -> None:
        """Finalize a background save that has finished; cheap, not collective."""
        if self._pending is not None and (
            self._pending.future is None or self._pending.future.done()
        ):
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is on disk; rank 0 then marks it complete."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        if self.rank != 0:
            return
        # The DCP metadata is written only after every rank's shards: all data is on disk.
        (pending.tmp / META).write_text(json.dumps(pending.meta, indent=1) + "\n")
        if self.faults is not None:
            self.faults.before_commit(pending.step)
        final = step_dir(self.root, pending.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(pending.tmp, final)
        for _, old in complete_checkpoints(self.root)[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self, state: TrainState, loader: DataLoader, step: int | None = None) -> int:
        """Load the newest complete checkpoint (or that of `step`) into `state` and `loader`
        and return its step; 0 (nothing loaded) when there is none. Collective."""
        path = find_checkpoint(self.root, step)
        if path is None:
            if step is not None:
                raise FileNotFoundError(f"no complete checkpoint of step {step} in {self.root}")
            return 0
        meta = read_meta(path)
        model = _named_model(state)
        # The optimizer's states only: its groups (which depend on the layout) and their
        # hyperparameters come from the recipe, and the lr from the restored schedule.
        if isinstance(state.optimizer, ZeroRedundancyOptimizer):
            _init_zero1_state(state.optimizer)
            model_sd = get_model_state_dict(model)
            optim_sd = _zero1_optim_state(state.optimizer, state.plain)
            # Only this rank's optimizer states: the shares of other ranks stay on disk.
            load_resizing_vocab({"model": model_sd, "optim": {"state": optim_sd["state"]}}, path)
            set_model_state_dict(model, model_sd)
        else:
            model_sd, optim_sd = get_state_dict(model, state.optimizer)
            read = read_tied_copy_from_embedding(model, model_sd, optim_sd["state"])
            load_resizing_vocab({"model": read[0], "optim": {"state": read[1]}}, path)
            set_state_dict(
                model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
            )
        if state.stash is not None:
            _restore_stash(state, path)
        groups = len(state.optimizer.param_groups)
        state.scheduler.load_state_dict(_scheduler_state(meta["scheduler"], groups))
        # LambdaLR sets the groups' lr only when it steps: apply the restored one now.
        for group, lr in zip(
            state.optimizer.param_groups, state.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr
        loader.load_state_dict(meta["data"])
        if "loss_scaler" in meta:
            state.scaler.load_state_dict(meta["loss_scaler"])
        wandb_id = self.root.parent / WANDB_ID_FILE
        if self.rank == 0 and meta.get("wandb_run_id") and not wandb_id.exists():
            # Continue the same W&B run even if the run dir lost the id file.
            wandb_id.write_text(meta["wandb_run_id"] + "\n")
        rng = path / "rng" / f"rank_{self.rank}.pt"
        if meta["world_size"] == self.world_size and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        self.saved_step = int(meta["step"])
        return self.saved_step
