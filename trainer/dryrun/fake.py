"""The fake world one rank of a job runs in: torch's fake process group at the job's world
size (collectives return at once, moving nothing) and fake tensors (shapes, dtypes and
devices, no storage).

DTensor infers each op's output shape by running it on fake tensors of the global shape,
in the fake mode it finds; here that would be the dry run's, under the memory tracker,
which would count every full-size shadow tensor. The inference gets a fake mode of its own.

Three things cannot run on fake tensors and run on real ones here, none holding storage:
the plain model is built on the meta device outside fake mode (torch cannot `to_empty` a
fake parameter: it swaps tensors, which a fake tensor's weak references forbid); a DeviceMesh
computes its coordinates from its small tensor of ranks (data-dependent ops), the
bad-step agreement reads the loss and the norm (`FakeStepGuard`; PipeDream-2BW's update
reads its agreed flags, `read_agreement`, taken as a clean step). A dropless expert-parallel
dispatch learns its slots from the loads it reads after a step; under fake tensors there
are none to read, so its slots stay as first sized (the all-reduce is still issued).

Two start-up exchanges read values a fake group never delivers. torch's pipeline schedule
agrees over the pipeline whether every stage knows its shapes (a vote read with `.item()`):
the vote's messages are still sent, and each stage takes its own vote, which is every
stage's since all are given their shapes from the same recipe; torch's own check of every
stage's tensors against those shapes is switched on, so a shape the recipe derives wrongly
fails the dry run. DDP checks the parameters' shapes against rank 0's and broadcasts rank
0's values; both are skipped (every rank initializes the same weights), and its gradient
buckets are reduced through a hook of the same arithmetic, since the reducer's own reads the
reduced bucket back from the group's future, which a fake group leaves empty.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes

import pretrain.trainer.build
import pretrain.trainer.step.local
import pretrain.trainer.step.pipedream
from pretrain import models


def _outside_modes(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return wrapper


def _slots_as_sized(_: Callable[..., Any]) -> Callable[..., Any]:
    def settle(model: Any, n_layers: int, device: torch.device) -> bool:
        dist.all_reduce(torch.zeros(2, n_layers, dtype=torch.long, device=device))
        return False

    return settle


def _own_votes(warmup: Callable[..., Any]) -> Callable[..., Any]:
    def vote(schedule: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        # On real 4-byte tensors: the messages are issued and counted; what arrives is the
        # fake group's nothing, so the outcome torch reads from it is overridden below.
        with unset_fake_temporarily():
            warmup(schedule, stages, has_backward, p2p_done)
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} was given no shapes")
            stage._inference_mode = InferenceMode.STATIC
            stage._runtime_validate = True

    return vote


def _without_init_sync(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def wrapper(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs, init_sync=False)

    return wrapper


def _reduced_in_place(apply_ddp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(apply_ddp)
    def wrapper(model: Any, mesh: Any, *args: Any) -> DistributedDataParallel:
        ddp = apply_ddp(model, mesh, *args)
        if not ddp._comm_hooks:  # the recipe's reduction dtype brings its own hook
            ddp.register_comm_hook(mesh.dp_cp.get_group(), _mean_in_place)
        return ddp

    return wrapper


def _mean_in_place(group: dist.ProcessGroup, bucket):  # unannotated: DDP checks the types
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True)
    return work.get_future().then(lambda _: buffer)


def _on_real_tensors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Join a fake process group as `rank` of `world_size`, left on exit. The job's mesh is
    built inside it and before `fake_tensors` (from real tensors of ranks)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # Meshes FSDP and DTensor build on the way (sub-meshes, concatenations) need their
    # coordinates too; the mesh tensor holds world_size integers, never model state.
    patches = [
        (DeviceMesh, "__init__", _on_real_tensors),
        (ShardingPropagator, "_propagate_tensor_meta_non_cached", _outside_modes),
        (models, "build", _on_real_tensors),
        (pretrain.trainer.step.local, "settle_slot_bounds", _slots_as_sized),
        (_PipelineSchedule, "_warmup_p2p", _own_votes),
        (DistributedDataParallel, "__init__", _without_init_sync),
        (pretrain.trainer.build, "apply_ddp", _reduced_in_place),
        (pretrain.trainer.step.pipedream, "read_agreement", _agreed_clean),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, wrap in patches:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        dist.destroy_process_group()


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Attention as a CUDA job runs it, on the CPU's fake tensors: where the CPU would take
    SDPA's math path (a value head width unlike the query's, as MLA's), which keeps the
    whole score matrix for backward, run the memory-efficient kernel CUDA picks instead,
    which keeps the output and its log-sum-exp. Calls the CPU's fused kernel serves (the
    same widths, or a mask) are left as they are: it keeps what the CUDA kernels keep."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  **kwargs: Any) -> torch.Tensor:  # fmt: skip
        mask = args[0] if args else kwargs.get("attn_mask")
        plain = not args[1:] and set(kwargs) <= {"attn_mask", "is_causal", "scale"}
        if mask is not None or not plain or query.size(-1) == value.size(-1):
            return original(query, key, value, *args, **kwargs)
        causal, scale = kwargs.get("is_causal", False), kwargs.get("scale")
        out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, causal, scale=scale
        )
        return out

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def fake_tensors() -> FakeTensorMode:
    """Every tensor made inside is fake; the mesh's real rank tensors may be read."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class FakeStepGuard:
    """The step guard's agreement with its collective, without reading fake values: a dry
    run's step is never bad and never asked to stop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        # As StepGuard.agree: non-finite, stop and the loss, summed in float64.
        flags = torch.zeros(3, dtype=torch.float64, device=self.device)
        dist.all_reduce(flags)
        return False, False

    def stop_requested(self) -> bool:
        """No stop is ever requested of a dry run."""
        return False


def _agreed_clean(read: Callable[..., Any]) -> Callable[..., Any]:
    def clean(flags: torch.Tensor, norm: torch.Tensor) -> tuple[bool, bool, bool]:
        return False, True, False  # no bad loss, a finite norm, no stop

    return clean
