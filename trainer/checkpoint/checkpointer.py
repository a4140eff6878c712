"""Sharded, atomic, resumable checkpoints under RUN_DIR/checkpoints.

A checkpoint of step N is the folder `step_N` (zero-padded). It is written as `step_N.tmp`
and renamed by rank 0 once every rank's shards, the DCP metadata, each rank's RNG state and
`meta.json` are on disk, so a crash during a save leaves only a `.tmp` folder that resume
never picks. Inside:

- DCP shards of `{"model": ..., "optim": ...}` keyed by the plain model's parameter names
  (pipeline stages included), so `torch.distributed.checkpoint` reshards them on load under
  any layout; vocabulary rows padded for another tp are fitted
  (`trainer/checkpoint/vocab_resize.py`);
  PipeDream-2BW adds `"stash"`, its older weight version (`model` is the newest), after
  draining its pipeline (`TrainState.settle`); a run without one resumes both versions from
  `model`;
- `meta.json`: step, the data loader's position (layout-independent: stored once), the LR
  scheduler's state, the W&B run id and the layout it was saved under;
- `rng/rank_R.pt`: the RNG states of rank R (restored only under the same world size);
- `manifest.json`: every file's size and SHA-256, written last before the rename, and
  checked before a load; a checkpoint that fails is moved aside and the previous one is
  used (`trainer/checkpoint/integrity.py`, which also checks the free space before a save).
"""

from __future__ import annotations

import json
import os
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

from parallel.data_parallel import is_zero1_optimizer
from parallel.pipeline.tied_embedding import head_copies
from pretrain_core.run.checkpoint_files import DCP_METADATA, META, complete_checkpoints, step_dir
from pretrain_core.run.rundir import CHECKPOINTS_DIR, WANDB_ID_FILE
from pretrain_core.schema import CheckpointConfig
from pretrain_data.progress import human
from pretrain_data.waiting import Wait
from trainer.checkpoint import integrity
from trainer.checkpoint.vocab_resize import load_resizing_vocab
from trainer.data.loader import DataLoader
from trainer.faults.injection import FaultInjector
from trainer.log import get_logger
from trainer.optim.states import StoredStateOptimizer
from trainer.step.state import TrainState

STASH = "stash"
"""DCP key of PipeDream-2BW's older weight version."""


EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"
"""The full model's names of a tied embedding and its LM head."""


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


def _zero1_optim_state(optimizer: torch.optim.Optimizer, plain: nn.Module) -> dict[str, Any]:
    """This rank's share of a ZeRO-1 optimizer, in the layout `get_state_dict` uses.

    Each rank holds the states of the parameters it owns; keyed by parameter name, the
    shares of all ranks are disjoint and together make the full optimizer state, which any
    layout can load (and a ZeRO-1 rank loads only the names it owns).
    """
    names = _names(plain)
    local = optimizer.optim
    stored = isinstance(local, StoredStateOptimizer)
    state = {
        # States kept in another dtype are saved in FP32 (trainer/optim/states.py).
        names[id(p)]: local.float_state(p) if stored else local.state[p]
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


def _store_zero1_states(
    optimizer: torch.optim.Optimizer, plain: nn.Module, loaded: dict[str, Any]
) -> None:
    """Put loaded FP32 states back into an optimizer that keeps them in another dtype (the
    loaded tensors of the others are the live states, filled in place)."""
    local = optimizer.optim
    if not isinstance(local, StoredStateOptimizer):
        return
    names = _names(plain)
    for group in local.param_groups:
        for p in group["params"]:
            if names[id(p)] in loaded:
                local.load_float_state(p, loaded[names[id(p)]])


@torch.no_grad()
def _init_zero1_state(optimizer: torch.optim.Optimizer) -> None:
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


def _collective_device() -> torch.device:
    """Where this rank's collectives take their tensors: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _state_dicts(state: TrainState) -> dict[str, Any]:
    model = _named_model(state)
    if is_zero1_optimizer(state.optimizer):
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
    sums: dict[str, dict[str, Any]]
    """Sizes and checksums of the files the ranks wrote (empty for a background save:
    rank 0 computes them all for the manifest)."""


def _loading(step: int, path: Path) -> Wait:
    """The progress display of verifying and loading the checkpoint at `path` (its size
    counted once); lines through the trainer's logger (rank 0's)."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    what = f"checkpoint: loading step {step} ({human(size)}B) from {path}"
    return Wait(what, get_logger().info, announce=False)


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
        state_dict = _state_dicts(state)
        integrity.check_free_space(self.root, step, state_dict, _collective_device())
        tmp = step_dir(self.root, step).with_name(step_dir(self.root, step).name + ".tmp")
        if self.rank == 0:
            # A previous attempt at this step that crashed mid-save: ours to clear.
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        wandb_id = self.root.parent / WANDB_ID_FILE
        full_meta = {
            "step": step,
            "wandb_run_id": wandb_id.read_text().strip() if wandb_id.is_file() else None,
            "world_size": self.world_size,
            "data": loader.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "loss_scaler": state.scaler.state_dict(),
        }
        future = None
        try:
            torch.save(_rng_state(), tmp / "rng" / f"rank_{self.rank}.pt")
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
        except Exception as error:
            self._save_failed(step, tmp, error)
            raise
        sums = self._gathered_sums(tmp) if future is None else {}
        self._pending = _Pending(step, tmp, full_meta, future, sums)
        self.saved_step = step
        if future is None:
            self.wait()

    def _save_failed(self, step: int, tmp: Path, error: Exception) -> None:
        """A save that failed on a full disk: rank 0 frees what it wrote, and the error
        names the disk (re-raised by the caller otherwise)."""
        full = integrity.disk_full_now(self.root, step, error)
        if full is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise full from error

    def _gathered_sums(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Each rank checksums the files it wrote; rank 0 receives them all (collective)."""
        mine = integrity.checksums(tmp, integrity.own_files(tmp, self.rank))
        gathered: list[dict | None] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        return {name: entry for part in gathered if part for name, entry in part.items()}

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
        integrity.write_manifest(pending.tmp, pending.sums)
        if self.faults is not None:
            self.faults.before_commit(pending.step)
        final = step_dir(self.root, pending.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(pending.tmp, final)
        for _, old in complete_checkpoints(self.root)[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Wait for the pending save, then end DCP's background save process (process mode)
        with its terminate request, so that it does not die noisily on a closed pipe when this
        rank exits."""
        self.wait()
        if self.cfg.async_mode == "process":
            from torch.distributed.checkpoint import _async_process_executor

            # Private, but DCP keeps its one background process here; dropping the last
            # reference sends the request and joins the process (its __del__).
            _async_process_executor._CHECKPOINT_PROCESS = None

    def restore(self, state: TrainState, loader: DataLoader, step: int | None = None) -> int:
        """Load the newest usable checkpoint (or that of `step`) into `state` and `loader`
        and return its step; 0 (nothing loaded) when there is none. Collective.

        Unfinished saves are removed first. A checkpoint that fails verification or loading
        is moved aside and named in the log, and the previous one is tried; when none is
        left, NoUsableCheckpoint says which failed and why.
        """
        if self.rank == 0:
            for path in integrity.remove_unfinished(self.root):
                get_logger().info("removed %s, a save that never finished", path.name)
        candidates = integrity.step_dirs(self.root)
        if step is not None:
            candidates = [(s, p) for s, p in candidates if s == step]
            if not candidates:
                raise FileNotFoundError(f"no checkpoint of step {step} in {self.root}")
        failures = []
        for step_of, path in candidates:
            with _loading(step_of, path) as wait:
                problems = integrity.verify(
                    path, META, DCP_METADATA, self.rank, self.world_size
                ) or self._agreed_load(path, state, loader)
                done = wait.what.replace("loading", "loaded", 1)
                wait.outcome = f"checkpoint: could not load step {step_of}" if problems else done
            if not problems:
                return self.saved_step
            failures.append(f"{path.name}: {'; '.join(problems)}")
            self._set_aside(path, problems)
        if failures:
            raise integrity.NoUsableCheckpoint(self.root, failures)
        return 0

    def _agreed_load(self, path: Path, state: TrainState, loader: DataLoader) -> list[str]:
        """Load `path`; the problems if any rank failed to (all ranks agree)."""
        try:
            self._load(path, state, loader)
            error = ""
        except Exception as exc:  # a checkpoint that does not load is reported, not fatal
            error = f"it does not load ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error)
        return sorted({e for e in errors if e})

    def _set_aside(self, path: Path, problems: list[str]) -> None:
        """Rank 0 moves a bad checkpoint aside (kept for inspection) and says so."""
        if self.rank == 0:
            moved = integrity.set_aside(path)
            get_logger().warning(
                "checkpoint %s is unusable (%s); moved to %s, trying the previous one",
                path.name, "; ".join(problems), moved.name,
            )  # fmt: skip
        dist.barrier()

    def _load(self, path: Path, state: TrainState, loader: DataLoader) -> int:
        """Load the checkpoint at `path` into `state` and `loader`; its step."""
        meta = read_meta(path)
        model = _named_model(state)
        # The optimizer's states only: its groups (which depend on the layout) and their
        # hyperparameters come from the recipe, and the lr from the restored schedule.
        if is_zero1_optimizer(state.optimizer):
            _init_zero1_state(state.optimizer)
            model_sd = get_model_state_dict(model)
            optim_sd = _zero1_optim_state(state.optimizer, state.plain)
            # Only this rank's optimizer states: the shares of other ranks stay on disk.
            load_resizing_vocab({"model": model_sd, "optim": {"state": optim_sd["state"]}}, path)
            set_model_state_dict(model, model_sd)
            _store_zero1_states(state.optimizer, state.plain, optim_sd["state"])
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
