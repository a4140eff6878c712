"""Pipeline bubble and saved activations, measured: PP=2 under GPipe and 1F1B on CPU.

Two gloo ranks run the repo's schedule builder (`pretrain.parallel.pipeline.stages.build_schedule`)
over a
stack of MLP blocks split into two stages, for m = 2, 4 and 8 micro-batches of fixed size.
Per stage it measures:

- idle fraction: 1 - (time inside the stage's forward and backward) / (step time), the
  median over timed steps; waiting for a peer's activations or gradients counts as idle;
- peak saved-activation bytes: what autograd holds for backward (saved-tensor hooks, each
  tensor counted while saved, parameters excluded), at its peak during the step.

Beside them: the bubble the plan predicts, (p-1)/(m+p-1), and the peak micro-batches in
flight of the simulated schedule (`launcher/plan/pipeline/schedule_sim.py`).

A second table runs many steps back to back under 1F1B, the V schedules (ZB-V, DualPipeV:
two chunks per rank, each half a stage's blocks) and PipeDream-2BW
(`parallel/pipeline/pipedream.py`,
never flushed; each step's update agreed without blocking, as the trainer does), every
step with the same SGD update of the stage's weights (2BW's also copies the version in
use first, and runs mid-pipeline, where a rank's update delays its neighbours). It reports
the time per step and each rank's time blocked waiting for a peer (every receive and send
wait) as a share of the run, beside the simulated bubble of the same order (F = B = W, no
update time).

    torchrun --standalone --nproc-per-node 2 bench/pipeline_bubble.py [--steps 6] [--long 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules

from pretrain.core.schema import ParallelConfig
from pretrain.core.stages import rank_stages
from pretrain.launcher.plan.pipeline.schedule_sim import bubble_fraction, pipedream_bubble, simulate
from pretrain.parallel.pipeline.pipedream import P2PTransport, PipeDream, Version, copy_weights
from pretrain.parallel.pipeline.stages import build_schedule

DIM, HIDDEN, BLOCKS_PER_STAGE, ROWS = 512, 2048, 2, 64
CPU = torch.device("cpu")


def mlp_blocks(count: int) -> nn.Sequential:
    """`count` MLP blocks (DIM -> HIDDEN -> DIM)."""
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
            for _ in range(count)
        ]
    )


class Timed(nn.Module):
    """A stage whose forward and backward wall times are summed into `busy`.

    Its backward hooks hand out views of the outputs, which the split-backward schedules
    cannot detach: the second table runs plain blocks and times the waits instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = mlp_blocks(BLOCKS_PER_STAGE)
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


class Waits:
    """Seconds this rank spent blocked on a peer, however the schedule waits for it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        wait = schedules._wait_batch_p2p

        def timed(work):
            start = time.perf_counter()
            wait(work)
            self.seconds += time.perf_counter() - start

        schedules._wait_batch_p2p = timed  # torch's schedules wait for every P2P through it


class TimedTransport(P2PTransport):
    """2BW's transport, timing its blocking receives and send waits into `waits`."""

    def __init__(self, waits: Waits, *args) -> None:
        super().__init__(*args)
        self.waits = waits

    def _timed(self, call, *args):
        start = time.perf_counter()
        result = call(*args)
        self.waits.seconds += time.perf_counter() - start
        return result

    def recv_forward(self, mb):
        return self._timed(super().recv_forward, mb)

    def recv_backward(self, mb, like):
        return self._timed(super().recv_backward, mb, like)

    def flush(self):
        self._timed(super().flush)


def mse(m: int):
    return lambda out, target: ((out - target) ** 2).mean() / m


def run_flushed(name: str, m: int, steps: int, waits: Waits) -> float:
    """Seconds of `steps` steps of torch's schedule `name` (two chunks in a V for zbv and
    dualpipev, one whole stage otherwise)."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vpp = 2 if name in ("zbv", "dualpipev") else 1
    chunks = [mlp_blocks(BLOCKS_PER_STAGE // vpp) for _ in range(vpp)]
    stages = rank_stages(rank, pp, vpp, "v" if vpp == 2 else "loop")
    parallel = ParallelConfig(pp=pp, vpp=vpp, pp_schedule=name)
    schedule = build_schedule(chunks, stages, parallel, m, mse(m), dist.group.WORLD, CPU)
    inputs, targets = torch.randn(m * ROWS, DIM), torch.randn(m * ROWS, DIM)
    first, last = 0 in stages, pp * vpp - 1 in stages
    schedule.step(*((inputs,) if first else ()), target=targets if last else None)
    params = [p for chunk in chunks for p in chunk.parameters()]
    sgd(params)  # the first step also inferred shapes: untimed
    dist.barrier()
    waits.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        schedule.step(
            *((inputs,) if first else ()), target=targets if last else None, return_outputs=False
        )
        sgd(params)
    return time.perf_counter() - start


def sgd(params: list[nn.Parameter]) -> None:
    """The update every schedule's step ends with (the optimizer's cost, roughly)."""
    with torch.no_grad():
        for p in params:
            p -= 1e-3 * p.grad
            p.grad = None


def run_2bw(m: int, steps: int, waits: Waits) -> float:
    """Seconds of `steps` steps of PipeDream-2BW, back to back, and the drain after them."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    versions = (Version(mlp_blocks(BLOCKS_PER_STAGE)), Version(mlp_blocks(BLOCKS_PER_STAGE)))
    copy_weights(versions[1].params, versions[0].params)
    group = dist.new_group()
    pending: list = []

    def ready(version):  # agree on the gradient without blocking, as the trainer does
        squared = torch.stack([p.grad.pow(2).sum() for p in version.params]).sum()
        pending.append(dist.all_reduce(squared, group=group, async_op=True))

    def update(target, source):
        pending.pop(0).wait()
        sgd(target.params)

    transport = TimedTransport(waits, dist.group.WORLD, rank, pp, CPU, (ROWS, DIM), torch.float32)
    engine = PipeDream(versions, pp, rank, m, mse(m), transport, update, ready)
    inputs, targets = torch.randn(m * ROWS, DIM), torch.randn(m * ROWS, DIM)
    dist.barrier()
    waits.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        for op in engine.begin(list(inputs.chunk(m)), list(targets.chunk(m))):
            engine.run(*op)
        engine.end()
    for op in engine.drain_ops():
        engine.run(*op)
    engine.end_drain()
    return time.perf_counter() - start


def continuous_table(steps: int) -> None:
    """Idle share of many steps per schedule, measured and simulated, at pp = world size."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    waits = Waits()
    rows = []
    for m in (4, 8):
        for name in ("1f1b", "zbv", "dualpipev", "2bw"):
            if name == "dualpipev" and m < 2 * pp:
                continue
            elapsed = (
                run_2bw(m, steps, waits) if name == "2bw" else run_flushed(name, m, steps, waits)
            )
            gathered = [None] * pp
            dist.all_gather_object(gathered, (waits.seconds / elapsed, elapsed / steps))
            if name == "2bw":
                simulated = pipedream_bubble(pp, m, steps)
            else:
                vpp = 2 if name != "1f1b" else 1
                simulated = simulate(name, pp, m, vpp).bubble_fraction
            rows.append((name, m, [w for w, _ in gathered], simulated, max(t for _, t in gathered)))
    if rank == 0:
        print(f"\n{steps} steps back to back, PP={pp}, each with its update:\n")
        print(
            "| schedule | m | simulated bubble (F=B=W) | ms per step | "
            + " | ".join(f"wait rank {r}" for r in range(pp))
            + " | mean wait |"
        )
        print("| --- | --- | --- | --- | " + " | ".join("---" for _ in range(pp)) + " | --- |")
        for name, m, gathered, simulated, step_s in rows:
            waits_text = " | ".join(f"{w:.1%}" for w in gathered)
            mean = sum(gathered) / pp
            print(
                f"| {name} | {m} | {simulated:.1%} | {1e3 * step_s:.0f} | {waits_text} "
                f"| {mean:.1%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--long", type=int, default=20, help="steps of the second table")
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
    continuous_table(args.long)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
