"""One rank of a job, dry: the trainer's real build (`pretrain.trainer.build.build_train_state`,
every
`parallel.apply_*`) and one real optimizer step (every micro-batch through the layout's
stepper, backward, clipping, the optimizer's update) in a fake world (`trainer/dryrun/fake.py`),
with torch's memory tracker and a collective counter watching.

What does not run: data loading (synthetic token batches of the recipe's shapes instead),
checkpoint I/O, metrics sinks and the watchdog; nothing is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import RecipeConfig
from pretrain.parallel.data_parallel import ddp_bucket_bytes
from pretrain.parallel.mesh import JobMesh, build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.dryrun.collectives import CollectiveCounter
from pretrain.trainer.dryrun.fake import FakeStepGuard, cuda_attention, fake_tensors, fake_world
from pretrain.trainer.dryrun.tracker import StepMemTracker
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import LocalStep
from pretrain.trainer.step.phases import StepPhases
from pretrain.trainer.step.pipeline import pipeline_step
from pretrain.trainer.step.state import MicroBatches, Stepper

GIB = 2**30


def synthetic_batches(cfg: RecipeConfig, device: torch.device) -> MicroBatches:
    """One step's micro-batches of token ids, of the shapes the loader gives this rank."""
    shape = (cfg.train.micro_batch, cfg.train.seq_len)
    return [
        (
            torch.randint(0, cfg.model.vocab_size, shape, device=device),
            torch.randint(0, cfg.model.vocab_size, shape, device=device),
        )
        for _ in range(grad_accum_steps(cfg))
    ]


def dry_run_device(job_device: str) -> torch.device:
    """The device type the fake tensors carry: the job's, or the host's where this machine
    has no CUDA (FSDP asks the CUDA runtime for its current device, even under fake mode)."""
    if job_device == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(job_device, 0) if job_device == "cuda" else torch.device(job_device)


def dry_run(cfg: RecipeConfig, rank: int) -> dict[str, Any]:
    """Build rank `rank` of `cfg`'s job and run one step under fake tensors (PipeDream-2BW:
    two, the second measured); what it held at its peak (by category, in bytes), where, and
    the collectives it issued."""
    start = time.monotonic()
    degrees = resolve_degrees(cfg)
    if not 0 <= rank < degrees.world:
        raise ValueError(f"dryrun.rank={rank}: the job has ranks 0 to {degrees.world - 1}")
    device = dry_run_device(cfg.cluster.device)
    with fake_world(rank, degrees.world):
        mesh = build_mesh(degrees, device.type)
        counter = CollectiveCounter()
        tracker = StepMemTracker()
        on_cuda = cuda_attention() if cfg.cluster.device == "cuda" else contextlib.nullcontext()
        with fake_tensors(), counter, on_cuda:
            with _while("building the model and optimizer"):
                state = build_train_state(cfg, mesh, device)
            state.phases = StepPhases(device)
            ctx = StepContext(state, cfg, degrees, device, mesh, FakeStepGuard(device))  # type: ignore[arg-type]
            stepper: Stepper = pipeline_step(ctx) if degrees.pp > 1 else LocalStep(ctx)
            micro_batches = synthetic_batches(cfg, device)
            # PipeDream-2BW's second weight version is a model of its own.
            versions = [state.model] + ([state.stash] if state.stash is not None else [])
            tracker.track_external(*versions, state.optimizer)
            built = _device_bytes(tracker.get_tracker_snapshot("current"), device, {})
            build_bytes = dict(counter.bytes)
            counter.bytes.clear()
            counter.calls.clear()
            with tracker, _while("running the training step"):
                if SCHEDULES[cfg.parallel.pp_schedule].weight_versions > 1 and degrees.pp > 1:
                    # PipeDream-2BW's first step fills the pipeline and updates nothing; the
                    # second runs the first's last backwards beside its own and applies the
                    # first's gradient: the step of every later one, which is measured.
                    stepper.step(micro_batches)
                    counter.bytes.clear()
                    counter.calls.clear()
                stepper.step(micro_batches)
        # DDP's gradient buckets are allocated as it starts, before the tracker watches.
        chunks = list(state.model) if degrees.pp > 1 else [state.model]
        chunks += list(state.stash.chunks) if state.stash is not None else []
        buckets = {"Gradient": sum(ddp_bucket_bytes(chunk) for chunk in chunks)}
        peak = _device_bytes(tracker.get_tracker_snapshot("peak"), device, buckets)
        after = _device_bytes(tracker.get_tracker_snapshot("current"), device, buckets)
        computing = _device_bytes(tracker.compute_peak, device, buckets)
        coordinates = _coordinates(mesh)
    # The step measured runs its forwards and backwards before the optimizer has states;
    # every later step's hold them (the plan's peak is that of a later step): its peak is
    # the larger of the optimizer step's and that of the compute with the states added.
    states = after.get("Optstate", 0) - computing.get("Optstate", 0)
    peak_at = tracker.peak_at
    if computing.get("Total", 0) + states > peak.get("Total", 0):
        peak = computing | {"Optstate": after.get("Optstate", 0)}
        peak["Total"] = computing.get("Total", 0) + states
        peak_at = tracker.compute_peak_at
    steady = peak.get("Total", 0)
    return {
        "rank": rank,
        "device": device.type,
        "world_size": degrees.world,
        "coordinates": coordinates,
        "micro_batches": len(micro_batches),
        "built": built,
        "peak": peak,
        "peak_at": peak_at,
        "after_step": after,
        "steady_peak": steady,
        "peak_gib": steady / GIB,
        "collectives": _by_kind(counter.bytes),
        "collective_calls": _by_kind(counter.calls),
        "collectives_by_group": {key: int(b) for key, b in counter.bytes.items()},
        "collective_calls_by_group": {key: int(n) for key, n in counter.calls.items()},
        "build_collectives": {kind: int(b) for kind, b in build_bytes.items()},
        "seconds": time.monotonic() - start,
    }


def _by_kind(figures: dict[str, int]) -> dict[str, int]:
    """ "all_gather over 8" and "all_gather over 2" summed as all_gather."""
    kinds: dict[str, int] = {}
    for key, value in figures.items():
        kind = key.split(" over ")[0]
        kinds[kind] = kinds.get(kind, 0) + int(value)
    return kinds


class DryRunFailure(RuntimeError):
    """The layout failed to build or step; the message says at which point and why."""


@contextlib.contextmanager
def _while(doing: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise DryRunFailure(f"{doing}: {_reason(error)}") from error


def _reason(error: BaseException) -> str:
    """The error on one line, with the error it was raised from where it wraps one (torch's
    pipeline stages report a failed forward by its arguments, the cause underneath)."""
    reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    if root is error:
        return reason
    return f"{reason}; from {type(root).__name__}: {' '.join(str(root).split())}"


def _device_bytes(
    snapshot: dict[torch.device, dict[str, int]], device: torch.device, untracked: dict[str, int]
) -> dict[str, int]:
    """The snapshot's figures for the job's device (the host's too, under offload), with
    `untracked` bytes on the job's device added to their categories and the total."""
    out = {key: value for key, value in untracked.items() if value}
    if out:
        out["Total"] = sum(out.values())
    for dev, figures in snapshot.items():
        prefix = "" if dev.type == device.type else f"{dev.type}:"
        for key, value in figures.items():
            out[prefix + key] = out.get(prefix + key, 0) + int(value)
    return out


def _coordinates(mesh: JobMesh) -> dict[str, int]:
    """This rank's place on each mesh dim."""
    names = mesh.world.mesh_dim_names or ()
    return dict(zip(names, mesh.world.get_coordinate() or (), strict=True))
