"""Pipeline bubble and saved activations, measured: PP=2 under GPipe and 1F1B on CPU.

Two gloo ranks run the repo's schedule builder (`parallel.pipeline.build_schedule`) over a
stack of MLP blocks split into two stages, for m = 2, 4 and 8 micro-batches of fixed size.
Per stage it measures:

- idle fraction: 1 - (time inside the stage's forward and backward) / (step time), the
  median over timed steps; waiting for a peer's activations or gradients counts as idle;
- peak saved-activation bytes: what autograd holds for backward (saved-tensor hooks, each
  tensor counted while saved, parameters excluded), at its peak during the step.

Beside them: the bubble the plan predicts, (p-1)/(m+p-1), and the peak micro-batches in
flight of the simulated schedule (`launcher/schedule_sim.py`).

    torchrun --standalone --nproc-per-node 2 bench/pipeline_bubble.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from launcher.schedule_sim import bubble_fraction, simulate
from parallel.pipeline import build_schedule
from pretrain_core.schema import ParallelConfig

DIM, HIDDEN, BLOCKS_PER_STAGE, ROWS = 512, 2048, 2, 64


class Timed(nn.Module):
    """A stage whose forward and backward wall times are summed into `busy`."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
                for _ in range(BLOCKS_PER_STAGE)
            ]
        )
        self.busy = 0.0
        self._backward_start = 0.0
        self.register_full_backward_pre_hook(self._start)
        # The first layer's weight gradient is the last one a stage's backward computes (a
        # full backward hook would never fire on the first stage, whose input needs no grad).
        self.blocks[0][0].weight.register_post_accumulate_grad_hook(self._stop)

    def _start(self, module, grad_output):
        self._backward_start = time.perf_counter()

    def _stop(self, param):
        self.busy += time.perf_counter() - self._backward_start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.blocks(x)
        self.busy += time.perf_counter() - start
        return out


class SavedBytes:
    """Bytes autograd currently saves for backward, and the peak since `reset`."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def reset(self) -> None:
        self.now = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        if isinstance(tensor, nn.Parameter):
            return tensor
        return _Held(tensor, self)

    @staticmethod
    def unpack(held):
        return held if isinstance(held, torch.Tensor) else held.tensor


class _Held:
    def __init__(self, tensor: torch.Tensor, counter: SavedBytes) -> None:
        self.tensor, self.counter = tensor, counter
        self.size = tensor.numel() * tensor.element_size()
        counter.now += self.size
        counter.peak = max(counter.peak, counter.now)

    def __del__(self) -> None:
        self.counter.now -= self.size


def measure(schedule_name: str, m: int, steps: int) -> tuple[float, int]:
    """Median idle fraction and peak saved bytes of this rank's stage."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stage = Timed()
    parallel = ParallelConfig(pp=pp, pp_schedule=schedule_name)
    schedule = build_schedule(
        [stage],
        [rank],
        parallel,
        m,
        lambda out, target: ((out - target) ** 2).mean() / m,
        dist.group.WORLD,
        torch.device("cpu"),
    )
    inputs, targets = torch.randn(m * ROWS, DIM), torch.randn(m * ROWS, DIM)
    saved = SavedBytes()
    idle, peaks = [], []
    for step in range(steps + 1):  # the first step also infers shapes: untimed
        dist.barrier()
        stage.busy, _ = 0.0, saved.reset()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=targets)
        elapsed = time.perf_counter() - start
        stage.zero_grad(set_to_none=True)
        if step:
            idle.append(1 - stage.busy / elapsed)
            peaks.append(saved.peak)
    return statistics.median(idle), max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for m in (2, 4, 8):
        for name in ("gpipe", "1f1b"):
            idle, peak = measure(name, m, args.steps)
            gathered = [None] * pp
            dist.all_gather_object(gathered, (idle, peak))
            flight = simulate(name, pp, m)
            rows.append((name, m, gathered, bubble_fraction(name, pp, m), flight))
    if rank == 0:
        print(f"PP={pp}, {BLOCKS_PER_STAGE} MLP blocks ({DIM}->{HIDDEN}->{DIM}) per stage, ")
        print(f"{ROWS} rows per micro-batch, fp32, torch {torch.__version__}, gloo on CPU\n")
        print(
            "| schedule | m | predicted bubble | measured idle stage 0 | stage 1 | "
            "simulated peak in flight (stage 0 / 1) | peak saved MiB stage 0 | stage 1 |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, m, gathered, predicted, flight in rows:
            idles = " | ".join(f"{idle:.1%}" for idle, _ in gathered)
            peaks = " | ".join(f"{peak / 2**20:.2f}" for _, peak in gathered)
            held = " / ".join(f"{flight.peak_in_flight(r):g}" for r in range(pp))
            print(f"| {name} | {m} | {predicted:.1%} | {idles} | {held} | {peaks} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
