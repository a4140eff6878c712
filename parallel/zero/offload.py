"""ZeRO-Infinity-style offload of the sharded model state to host memory (FSDP2).

`parallel.offload=params` gives FSDP2 a `CPUOffloadPolicy`: each rank's FP32 parameter
shards and their gradients live in host memory (pinned on CUDA, so the copies are
asynchronous), the optimizer states are created there and the optimizer step runs on the
host CPU; the device holds only the unsharded compute copies of the blocks in use. Under
ZeRO-3 that leaves the device about the activations and one or two blocks' parameters.
Gradient-norm clipping then reduces host tensors, which is why the process group gets a
gloo backend for CPU tensors beside NCCL (`trainer/dist.py`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from pretrain.core.schema import ParallelConfig


def offload_policy(parallel: ParallelConfig, device_type: str) -> OffloadPolicy:
    """FSDP2's offload policy for the recipe: host-resident shards, or none."""
    if parallel.offload == "params":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def optimizer_device_type(parallel: ParallelConfig, device_type: str) -> str:
    """Where the optimizer's states and step live: the host under parameter offload."""
    return "cpu" if parallel.offload == "params" else device_type


def offloaded_modules(model: nn.Module) -> int:
    """How many of the model's FSDP2 units keep their shards in host memory (as FSDP2 was
    actually set up, not as the recipe asks)."""
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            count += group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)
    return count
