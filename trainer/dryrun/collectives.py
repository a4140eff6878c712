"""Counts the collectives one rank issues: kind, group size and bytes, from the dispatcher.

Every collective torch issues (FSDP2's all-gathers and reduce-scatters, DTensor's
redistributions, the pipeline's sends and receives, plain `dist.all_reduce`) reaches the
dispatcher as a `c10d` or `_c10d_functional` op with its tensors as arguments; the bytes
counted are those of the tensors the op sends (its input), as a cost model counts them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = ("c10d", "_c10d_functional")
_SKIP = ("wait", "wait_tensor", "barrier", "monitored_barrier")
_INPUT_SECOND = (
    "_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
    "alltoall_base_", "alltoall_",
)  # fmt: skip
"""c10d ops whose first argument is the output: what they send is the second."""


def _kind(name: str) -> str:
    """`allreduce_`, `all_reduce`, `_allgather_base_` -> all_reduce, all_gather, ..."""
    base = name.strip("_").replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    base = base.replace("reduce_scatter_tensor", "reduce_scatter").replace("_into_tensor", "")
    base = base.replace("_reduce_scatter_base", "reduce_scatter").replace("_base", "")
    base = base.replace("alltoall", "all_to_all").replace("_single", "")
    return base.removesuffix("_coalesced").strip("_")


def _group_size(func: Any, args: Any, kwargs: dict) -> int:
    """Ranks in the op's group: c10d ops take the group, functional ones its name."""
    named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    if "group_size" in named:
        return int(named["group_size"])
    if "group_name" in named:
        return _resolve_process_group(named["group_name"]).size()
    group = named.get("process_group")
    return ProcessGroup.unbox(group).size() if group is not None else 1


class CollectiveCounter(TorchDispatchMode):
    """Bytes and calls per collective kind and group size ("all_gather over 8") while
    active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func._overloadpacket
        namespace = packet._qualified_op_name.split("::")[0]
        if namespace in _NAMESPACES:
            name = packet.__name__
            if name not in _SKIP:
                kind = f"{_kind(name)} over {_group_size(func, args, kwargs or {})}"
                sent = args[1] if namespace == "c10d" and name in _INPUT_SECOND else args[0]
                flat, _ = tree_flatten(sent)
                self.bytes[kind] += sum(
                    t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)
                )
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))
