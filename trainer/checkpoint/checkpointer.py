"""Sharded, atomic, resumable checkpoints under RUN_DIR/checkpoints of a map of objects that
save and load their own state (`Stateful`s; a training run's: `trainer/checkpoint/run_state.py`).

The checkpoint of step N is the folder `step_N` (zero-padded), written as `step_N.tmp` and
renamed by rank 0 once every file is on disk, so a crash during a save leaves only a `.tmp`
folder that resume never picks. Each object is kept under its name, in its format:

- sharded: DCP shards, keyed by the plain model's parameter names, resharded on load under
  any layout (vocabulary rows padded for another tp are fitted, `vocab_resize.py`);
- replicated: `meta.json` (rank 0's JSON), beside the step and the world size;
- per rank: `NAME/rank_R.pt`, restored only under the same world size.

`manifest.json` holds every file's size and SHA-256, written last before the rename and
checked before a load; a checkpoint that fails is moved aside and the previous one is used
(`integrity.py`, which also checks the free space before a save). An object the checkpoint
holds nothing of keeps its state (or is told through its `load_absent()`); one with
`state_dict_for_load()` gives there what a load fills in place, and receives it filled.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from pretrain.core.inputs.reading import ReadError, integer, read_mapping
from pretrain.core.run.checkpoint_files import (
    DCP_METADATA,
    META,
    complete_checkpoints,
    find_checkpoint,
    step_dir,
)
from pretrain.core.run.rundir import CHECKPOINTS_DIR
from pretrain.core.schema import CheckpointConfig
from pretrain.trainer.checkpoint import integrity
from pretrain.trainer.checkpoint.vocab_resize import load_resizing_vocab
from pretrain.trainer.faults.injection import FaultInjector
from pretrain.trainer.log import get_logger

__all__ = [
    "DCP_METADATA", "META", "Checkpointer", "States", "complete_checkpoints", "find_checkpoint",
    "step_dir",
]  # fmt: skip


@dataclass
class States:
    """What a checkpoint holds: objects that save and load their own state, by name (the
    name is their key on disk), in the three formats a checkpoint has."""

    sharded: dict[str, Stateful]
    """In DCP's shards, resharded on load; loaded in this order, after one read of all."""
    replicated: dict[str, Stateful]
    """In meta.json: JSON values, the same on every rank."""
    per_rank: dict[str, Stateful]
    """In NAME/rank_R.pt, each rank's own."""
    settle: Callable[[], None] | None = None
    """Called before a save: brings the objects to a state a checkpoint can hold."""


class FolderWriter(Protocol):
    """Writes another kind of folder on its own cadence (trainer/checkpoint/hf_every.py)."""

    def due(self, step: int) -> bool:
        """Whether a folder is written after `step`."""
        ...

    def save(self, step: int) -> Path:
        """Write the folder of `step`; collective."""
        ...


def _loaded(obj: Any, state: Any) -> None:
    """Give `obj` its state from a checkpoint, or tell it there is none (`state` None)."""
    if state is not None:
        obj.load_state_dict(state)
    elif hasattr(obj, "load_absent"):
        obj.load_absent()


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


class Checkpointer:
    """Saves and restores one run's checkpoints; every rank makes the same calls."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        states: States,
        *,
        rank: int,
        world_size: int,
        faults: FaultInjector | None = None,
        hf: FolderWriter | None = None,
    ):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.states = states
        self.hf = hf
        """Writes the Hugging Face folders of checkpoint.hf_every (None: there are none)."""
        self.saved_step = 0
        """The step of the newest checkpoint written or restored."""
        self._pending: _Pending | None = None
        # Background saves run collectives while training runs its own: give them a group.
        self._group = dist.new_group(backend="gloo") if cfg.async_mode != "none" else None

    def due(self, step: int) -> bool:
        """Whether `step` (optimizer steps done) is a periodic save point."""
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def after_step(self, step: int, stop: bool) -> None:
        """Finalize a finished background save, and save `step` when it is a periodic save
        point or the job was asked to stop, and its Hugging Face folder when one is due;
        collective."""
        self.poll()
        if self.due(step) or stop:
            self.save(step)
        if self.hf is not None and self.hf.due(step):
            if self.states.settle is not None:
                self.states.settle()
            self.hf.save(step)

    def finish(self, step: int) -> None:
        """Save the final `step` unless it already was, and wait until it is on disk."""
        if self.saved_step != step:
            self.save(step)
        self.wait()

    def save(self, step: int) -> None:
        """Write the checkpoint of `step` (asynchronously if configured); collective."""
        self.wait()
        if self.states.settle is not None:
            self.states.settle()
        state_dict = {name: obj.state_dict() for name, obj in self.states.sharded.items()}
        integrity.check_free_space(self.root, step, state_dict)
        tmp = step_dir(self.root, step).with_name(step_dir(self.root, step).name + ".tmp")
        if self.rank == 0:
            # A previous attempt at this step that crashed mid-save: ours to clear.
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in self.states.per_rank:
                (tmp / name).mkdir()
        dist.barrier()
        full_meta = {"step": step, "world_size": self.world_size}
        full_meta.update((name, obj.state_dict()) for name, obj in self.states.replicated.items())
        future = None
        try:
            for name, obj in self.states.per_rank.items():
                torch.save(obj.state_dict(), tmp / name / f"rank_{self.rank}.pt")
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
            integrity.free_failed_save(self.root, step, tmp, error, self.rank)
            raise
        sums = integrity.gathered_checksums(tmp, self.rank, self.world_size) if not future else {}
        self._pending = _Pending(step, tmp, full_meta, future, sums)
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

    def restore(self, step: int | None = None) -> int:
        """Load the newest usable checkpoint (or that of `step`) into the states and return
        its step; 0 (nothing loaded) when there is none. Collective.

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
            with integrity.loading(step_of, path) as wait:
                problems = integrity.verify(
                    path, META, DCP_METADATA, self.rank, self.world_size
                ) or self._agreed_load(path)
                done = wait.what.replace("loading", "loaded", 1)
                wait.outcome = f"checkpoint: could not load step {step_of}" if problems else done
            if not problems:
                return self.saved_step
            failures.append(f"{path.name}: {'; '.join(problems)}")
            self._set_aside(path, problems)
        if failures:
            raise integrity.NoUsableCheckpoint(self.root, failures)
        return 0

    def _agreed_load(self, path: Path) -> list[str]:
        """Load `path`; the problems if any rank failed to (all ranks agree)."""
        try:
            self._load(path)
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

    def _load(self, path: Path) -> int:
        """Load the checkpoint at `path` into the states; its step."""
        meta = read_mapping(path / META, "a checkpoint's meta.json")
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        held = {key.split(".", 1)[0] for key in saved}
        targets = {
            name: getattr(obj, "state_dict_for_load", obj.state_dict)()
            for name, obj in self.states.sharded.items()
            if name in held
        }
        load_resizing_vocab(targets, path)
        for name, obj in self.states.sharded.items():
            _loaded(obj, targets.get(name))
        for name, obj in self.states.replicated.items():
            _loaded(obj, meta.get(name))
        if integer(meta.get("world_size"), path / META, "world_size") == self.world_size:
            for name, obj in self.states.per_rank.items():
                file = path / name / f"rank_{self.rank}.pt"
                _loaded(obj, torch.load(file, weights_only=False) if file.is_file() else None)
        step = integer(meta.get("step"), path / META, "step")
        if step is None:
            raise ReadError(path / META, "no step", "the step it was saved at", "save it again")
        self.saved_step = step
        return self.saved_step
