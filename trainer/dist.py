"""Process-group set-up for one rank: backend, device and the rank's place in the job."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pretrain.core.schema import ClusterConfig


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    node: int = 0
    """The node's rank in the job (torchrun's GROUP_RANK); global rank 0 is on node 0."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def system_node(self) -> int | None:
        """The node whose system metrics this rank records in a W&B run of its own: its node
        on the first local rank of every node but node 0 (the main run records that one)."""
        return self.node if self.local_rank == 0 and self.node > 0 else None


def init_distributed(
    cluster: ClusterConfig, timeout_s: float = 600.0, host_collectives: bool = False
) -> RankInfo:
    """Join the job's process group (gloo on CPU, NCCL on CUDA) from torchrun's environment;
    `host_collectives` adds gloo for CPU tensors on CUDA (offloaded gradients' norms).

    A single process started without torchrun still gets a one-rank group, so the trainer
    has one code path.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cluster.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "cluster.device=cuda but this node has no CUDA device; "
                "use cluster.device=cpu to run on CPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if "WORLD_SIZE" in os.environ and agent_store and attempt != "0":
        # After a restart, torchrun's store still holds the dead group's addresses under the
        # same keys; a prefix per attempt keeps the new group from dialing them.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timeout,
        )  # fmt: skip
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"attempt_{attempt}/", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # Started without torchrun: a one-rank group on an in-memory store needs no port.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        node=int(os.environ.get("GROUP_RANK", "0")),
    )
