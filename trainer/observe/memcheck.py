"""Measure one training step's peak memory per rank, by category, to check the planner.

    torchrun ... -m pretrain.trainer.observe.memcheck RUN_DIR/config.yaml OUT.json

Builds the rank's model and optimizer exactly as the trainer does (`build_train_state`),
runs one step on random tokens so the optimizer states exist, then tracks the second step
with `torch.distributed._tools.mem_tracker.MemTracker` (every tensor's storage, by
category, at the moment of the peak). DDP's gradient buckets are allocated before tracking
starts and live through the step, so they are read from DDP and added to the gradients.
Rank 0 writes every rank's figures to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.parallel.data_parallel import ddp_bucket_bytes
from pretrain.parallel.mesh import build_mesh
from pretrain.parallel.tensor import local_value
from pretrain.trainer.build import build_train_state
from pretrain.trainer.dist import init_distributed
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.local import train_step
from pretrain.trainer.step.pipeline import pipeline_step


class _StepTracker(MemTracker):
    """MemTracker that accepts a root module's forward once per accumulation micro-batch.

    MemTracker's module statistics are per iteration and it refuses a second forward of
    a root; only the device-wide peak is used here, so the module stats are reset. Under
    pipeline parallelism the roots are the rank's stage chunks, which the schedule calls.
    """

    def __init__(self, roots: list[nn.Module]) -> None:
        super().__init__()
        self._roots = roots
        self.peak_phase = ""
        self.peak_modules: list[str] = []

    def _update_peak_stats(self, peak_state) -> None:
        snapshot = next(iter(self._curr_mem_snap.values()), {})
        previous = next(iter(self._peak_mem.values()), 0)
        if snapshot.get("Total", 0) > previous:
            self.peak_phase = (
                "optimizer step"
                if self._in_opt
                else "backward"
                if self._mod_tracker.is_bw
                else "forward"
            )
            self.peak_modules = sorted(self._mod_tracker.parents)
        super()._update_peak_stats(peak_state)

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        root = any(module is r for r in self._roots)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if root and again:
            self.reset_mod_stats()
        elif again and set(self._mod_tracker.parents) - {
            self._mod_tracker.get_known_fqn(module)
        } == {"Global"}:
            # The LM head called chunk by chunk from the loss (train.loss_chunks), outside
            # any root: each call is a fresh top-level module for the tracker.
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


def measure(cfg: RecipeConfig) -> dict:
    """Peak bytes of this rank's second training step by category, and where the peak was."""
    degrees = resolve_degrees(cfg)
    device = torch.device("cpu")
    mesh = build_mesh(degrees, device.type)
    torch.manual_seed(cfg.seed)
    state = build_train_state(cfg, mesh, device)
    shape = (cfg.train.micro_batch, cfg.train.seq_len)

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (torch.randint(cfg.model.vocab_size, shape), torch.randint(cfg.model.vocab_size, shape))
            for _ in range(grad_accum_steps(cfg))
        ]

    if degrees.pp > 1:
        # Each rank runs its stage's part of the schedule.
        pipeline = pipeline_step(StepContext(state, cfg, degrees, device, mesh))

        def step(micro_batches: list) -> None:
            pipeline.step(micro_batches)

        roots = list(state.model)
    else:

        def step(micro_batches: list) -> None:
            train_step(StepContext(state, cfg, degrees, device), micro_batches)

        roots = [state.model]

    step(batches())
    tracker = _StepTracker(roots)
    tracker.track_external(state.model, state.optimizer)
    inner = getattr(state.optimizer, "optim", None)  # ZeroRedundancyOptimizer's local one
    if inner is not None:
        tracker.track_external(inner)
    step_batches = batches()
    with tracker:
        step(step_batches)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_name = {str(getattr(key, "value", key)): value for key, value in peak.items()}
    chunks = list(state.model) if degrees.pp > 1 else [state.model]
    buckets = sum(ddp_bucket_bytes(chunk) for chunk in chunks)
    # MemTracker counts FSDP's unsharded parameters as parameters too: "params" here is what
    # the rank keeps (its local shards and buffers), the unsharded copies go to "other".
    # From the wrapped model: under pipeline parallelism the stage view holds no buffers.
    resident = sum(local_value(p).untyped_storage().nbytes() for p in state.model.parameters())
    resident += sum(b.untyped_storage().nbytes() for b in state.model.buffers())
    tracked = by_name.get("Parameter", 0) + by_name.get("Buffer", 0)
    other = sum(by_name.get(k, 0) for k in ("Activation", "Temp", "Other")) + tracked - resident
    return {
        "params": resident,
        "grads": by_name.get("Gradient", 0) + buckets,
        "optimizer": by_name.get("Optstate", 0),
        "other": other,
        "ddp_buckets": buckets,
        "total": by_name["Total"] + buckets,
        "peak_phase": tracker.peak_phase,
        "peak_modules": tracker.peak_modules,
        "pp_rank": mesh.world["pp"].get_local_rank(),
        "tracked": by_name,
    }


def main(config_path: str, out_path: str) -> None:
    """Measure on every rank; rank 0 writes the list of per-rank figures as JSON."""
    cfg = load_config(config_path)
    init_distributed(cfg.cluster)
    try:
        figures = measure(cfg)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, figures)
        if dist.get_rank() == 0:
            Path(out_path).write_text(json.dumps(gathered, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pretrain.trainer.observe.memcheck RUN_DIR/config.yaml OUT.json")
    main(sys.argv[1], sys.argv[2])
    # As in trainer/__main__.py: skip interpreter teardown once the process group is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
