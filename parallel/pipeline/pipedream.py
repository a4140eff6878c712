"""PipeDream-2BW: a pipeline that is never flushed between optimizer steps, with two weight
versions per stage (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
ICML 2021).

Order: `core/pipedream.py` (shared with the planner's chart). Each rank keeps
p-1-r forwards ahead of its backwards across steps, so the last backwards of a step run in
the next one, between its forwards; only the pipeline's start and a checkpoint (which
drains it) leave a bubble.

Versions: a stage's weights exist twice, as two copies of its module. Every micro-batch of
a step runs its forward on the version in use for that step, and its backward runs through
the graph that forward built, so a micro-batch still in flight when the step ends is
backpropagated through the weights its forward saw (weight stashing comes with the graph),
and its gradient accumulates in that version's `.grad`. At the end of a step, once the
previous step's last backwards (the tail) have run, that step's gradient is complete: the
version in use is copied into the tail's version, which the `update` callback then steps
with the finished gradient (the optimizer follows it, `move_optimizer`), and the two swap
roles. So step k trains on W(k) and W(k+2) = update(W(k+1), grad f_k(W(k))): the 2BW
recurrence W(t+1) = W(t) - lr grad f(W(t-1)), one step of delay, with W(0) = W(1).

Transport: `P2PTransport` sends activations to the next rank and gradients to the previous
over the pipeline group (isend/irecv, in order, so messages match by position), each of the
shape and dtype the recipe gives every stage's hidden states (`parallel/pipeline/shapes.py`,
as torch's schedules are given them). `LocalTransport` keeps them in memory so `run_local`
can drive every stage's engine in one process (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pretrain.core import pipedream
from pretrain.parallel.tensor import local_value


@torch.no_grad()
def copy_weights(target: list[nn.Parameter], source: list[nn.Parameter]) -> None:
    """Copy every parameter of `source` into `target` (same layout, local shards)."""
    for t, s in zip(target, source, strict=True):
        local_value(t).copy_(local_value(s))


def move_optimizer(
    optimizer: torch.optim.Optimizer, old: list[nn.Parameter], new: list[nn.Parameter]
) -> None:
    """Make `optimizer` hold `new[i]` wherever it held `old[i]`, with the states it kept
    for it: the moments belong to the weights, not to one version of them."""
    if old is new:
        return
    mapping = dict(zip(map(id, old), new, strict=True))
    for group in optimizer.param_groups:
        group["params"] = [mapping[id(p)] for p in group["params"]]
    moved = {mapping[id(p)]: state for p, state in optimizer.state.items()}
    optimizer.state.clear()
    optimizer.state.update(moved)
    # ZeRO-1's sharded optimizer steps the parameters it owns with an optimizer of its own.
    owned = getattr(optimizer, "optim", None)
    if owned is not None:
        move_optimizer(owned, old, new)


@dataclass
class Version:
    """One weight version of a stage: the module that runs, and its parameters in a fixed
    order (taken before any forward: FSDP's sharded parameters, whatever FSDP registers)."""

    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.params:
            self.params = list(self.module.parameters())


class P2PTransport:
    """Activations to the next pipeline rank, gradients to the previous, in order; every
    activation between stages is of `shape` and `dtype`."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        pp: int,
        device: torch.device,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.group, self.device = group, device
        self.next = dist.get_global_rank(group, rank + 1) if rank < pp - 1 else None
        self.prev = dist.get_global_rank(group, rank - 1) if rank > 0 else None
        self.shape, self.dtype = shape, dtype
        self._sends: list = []

    def send_forward(self, mb: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            # The next rank receives into a buffer of the given shape: a mismatch would
            # arrive as garbage, or hang.
            raise RuntimeError(
                f"pipeline stage output {tuple(tensor.shape)} {tensor.dtype}: the stages "
                f"were given {tuple(self.shape)} {self.dtype}"
            )
        self._sends.append(dist.isend(tensor, self.next, self.group))

    def recv_forward(self, mb: int) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(tensor, self.prev, self.group)
        return tensor

    def send_backward(self, mb: int, tensor: torch.Tensor) -> None:
        self._sends.append(dist.isend(tensor.contiguous(), self.prev, self.group))

    def recv_backward(self, mb: int, like: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty_like(like)
        dist.recv(tensor, self.next, self.group)
        return tensor

    def ready(self, kind: str, mb: int) -> bool:
        return True

    def prune(self) -> None:
        """Forget the sends that completed. A step never waits for its own: the gradients of
        its last backwards are received by the previous rank in the next step, after the
        step-end collectives every rank joins."""
        self._sends = [work for work in self._sends if not work.is_completed()]

    def flush(self) -> None:
        """Wait for every send issued so far (after a drain, when all were received)."""
        for work in self._sends:
            work.wait()
        self._sends.clear()


class LocalTransport:
    """The messages between stages of one process: `mailbox[(rank, kind, mb)]`."""

    def __init__(self, mailbox: dict, rank: int) -> None:
        self.mailbox, self.rank = mailbox, rank

    def send_forward(self, mb: int, tensor: torch.Tensor) -> None:
        self.mailbox[(self.rank + 1, "F", mb)] = tensor.detach().clone()

    def recv_forward(self, mb: int) -> torch.Tensor:
        return self.mailbox.pop((self.rank, "F", mb))

    def send_backward(self, mb: int, tensor: torch.Tensor) -> None:
        self.mailbox[(self.rank - 1, "B", mb)] = tensor.clone()

    def recv_backward(self, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self.mailbox.pop((self.rank, "B", mb))

    def ready(self, kind: str, mb: int) -> bool:
        return (self.rank, kind, mb) in self.mailbox

    def prune(self) -> None:
        pass

    def flush(self) -> None:
        pass


Update = Callable[[Version, Version], None]
"""update(target, source): copy of `source`'s weights already in `target`; step `target`
with the gradient it holds (and make it the optimizer's)."""
GradientReady = Callable[[Version], None]
"""gradient_ready(version): this rank's gradient of a step is complete in `version` (its
update comes at the end of the next step: time to agree on it without blocking)."""


class PipeDream:
    """One pipeline rank's 2BW engine: two versions of its stage, run in the 2BW order."""

    def __init__(
        self,
        versions: tuple[Version, Version],
        pp: int,
        rank: int,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        transport,
        update: Update,
        gradient_ready: GradientReady | None = None,
        timed: Callable[[str], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        """`versions`: (the one the next step runs, the newest); equal at the start.
        `timed(name)`: a context around each backward's compute (the trainer's step
        breakdown; the receive it waits for stays outside it)."""
        self.versions = list(versions)
        self.current = 0
        self.pp, self.rank, self.m = pp, rank, microbatches
        self.first, self.last = rank == 0, rank == pp - 1
        self.loss_fn, self.transport, self.update = loss_fn, transport, update
        self.gradient_ready = gradient_ready
        self.timed = timed or (lambda name: contextlib.nullcontext())
        self.step_in_segment = 0
        self.inflight: dict[int, tuple[Version, torch.Tensor | None, torch.Tensor]] = {}
        self.inputs: list = []
        self.targets: list = []
        self.kwargs: list[dict[str, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    @property
    def newest(self) -> Version:
        """The version the optimizer last wrote (what a checkpoint calls the model)."""
        return self.versions[1 - self.current] if self.step_in_segment == 0 else self.running

    @property
    def running(self) -> Version:
        """The version this step's forwards use."""
        return self.versions[self.current]

    def begin(
        self, inputs: list, targets: list, kwargs: list[dict[str, torch.Tensor]] | None = None
    ) -> list[tuple[str, int]]:
        """Take this step's micro-batches (`inputs` on the first stage, `targets` on the
        last, `kwargs` of every stage's forward, such as the documents, on all); returns the
        ops to run (`run`), in order."""
        self.inputs, self.targets, self.losses = inputs, targets, []
        self.kwargs = kwargs or [{} for _ in range(self.m)]
        return pipedream.step_ops(self.pp, self.m, self.rank, self.step_in_segment)

    def run(self, kind: str, mb: int) -> None:
        """Run one op of this step (or of a drain)."""
        if kind == "F":
            self._forward(mb)
        else:
            self._backward(mb)

    def end(self) -> None:
        """Close the step: apply the previous step's gradient (its tail ran in this one),
        then the newest version runs the next step."""
        self.transport.prune()
        if self.step_in_segment > 0:
            self._apply()
        self.current = 1 - self.current
        self.step_in_segment += 1

    def drain_ops(self) -> list[tuple[str, int]]:
        """The backwards still owed: the last step's tail."""
        if self.step_in_segment == 0:
            return []
        return pipedream.drain(self.pp, self.m, self.rank, self.step_in_segment)

    def end_drain(self) -> None:
        """After the drain's backwards: apply the last step's gradient; a new segment starts
        with an empty pipeline, on the version that step k+1 must use."""
        self.transport.flush()
        if self.step_in_segment > 0:
            self._apply()
        self.step_in_segment = 0

    def _apply(self) -> None:
        # The tail's version (not running) is free now: it becomes update(running).
        target, source = self.versions[1 - self.current], self.running
        copy_weights(target.params, source.params)
        self.update(target, source)

    def _forward(self, mb: int) -> None:
        version = self.running
        local = mb - self.step_in_segment * self.m
        x = self.inputs[local] if self.first else self.transport.recv_forward(mb).requires_grad_()
        out = version.module(x, **self.kwargs[local])
        if self.last:
            loss = self.loss_fn(out, self.targets[local])
            self.losses.append(loss)
            self.inflight[mb] = (version, None if self.first else x, loss)
        else:
            self.transport.send_forward(mb, out)
            self.inflight[mb] = (version, None if self.first else x, out)

    def _backward(self, mb: int) -> None:
        version, x, out = self.inflight.pop(mb)  # the graph remembers the version
        grad = None if self.last else self.transport.recv_backward(mb, out)
        with self.timed("backward"):
            out.backward(grad)
        if x is not None:
            self.transport.send_backward(mb, x.grad)
        if self.gradient_ready is not None and (mb + 1) % self.m == 0:
            with self.timed("backward"):
                self.gradient_ready(version)


def run_local(engines: list[PipeDream], ops: list[list[tuple[str, int]]]) -> None:
    """Run every stage's ops in one process: any stage whose next op has its input runs it
    (each stage in its own order), until all are done."""
    queues = [deque(rank_ops) for rank_ops in ops]
    while any(queues):
        progressed = False
        for engine, queue in zip(engines, queues, strict=True):
            while queue and _has_input(engine, *queue[0]):
                engine.run(*queue.popleft())
                progressed = True
        if not progressed:
            raise RuntimeError("the 2BW order deadlocks")


def _has_input(engine: PipeDream, kind: str, mb: int) -> bool:
    if kind == "F":
        return engine.first or engine.transport.ready("F", mb)
    return engine.last or engine.transport.ready("B", mb)


def local_step(
    engines: list[PipeDream],
    inputs: list,
    targets: list,
    kwargs: list[dict[str, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """One 2BW step of a whole pipeline in one process (`kwargs`: of each micro-batch's
    forward on every stage); returns the last stage's losses."""
    ops = [engine.begin(inputs, targets, kwargs) for engine in engines]
    run_local(engines, ops)
    losses = engines[-1].losses
    for engine in engines:
        engine.end()
    return losses


def local_drain(engines: Iterable[PipeDream]) -> None:
    """Drain a one-process pipeline (its last step's tail) and apply the last gradient."""
    engines = list(engines)
    run_local(engines, [engine.drain_ops() for engine in engines])
    for engine in engines:
        engine.end_drain()
