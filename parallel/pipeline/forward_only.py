"""A forward-only pass through a pipeline's stages, outside any schedule: the validation loss
of every `parallel.pp_schedule`.

torch's V schedules have no forward-only pass (their `eval` runs the split backward's
actions) and PipeDream-2BW never drains for one, so every pipelined step evaluates here,
over the same stage modules (wrapped as training runs them) with sends and receives of its
own. Each rank runs its stages in model order and, within a stage, the micro-batches in
order (GPipe's forward): that order is a topological order of the pass on every rank, so
blocking receives and non-blocking sends cannot deadlock, whatever the placement (looped,
or the V whose middle rank hands its first stage's output to its second in memory).

The messages carry a tag of their own, so they never match a send of the training
schedule still in flight (2BW's last backwards of a step run in the next one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

TAG = 30
"""The tag of every message of the forward-only pass."""
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
"""Activation dtypes a header can name, by index."""
HEADER = 8
"""int64 entries of a header: ndim, dtype index, then the shape."""


def send_tensor(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    """Start sending `tensor` to global rank `dst`: a header (ndim, dtype, shape), then the
    data; the caller waits for the returned works."""
    tensor = tensor.detach().contiguous()
    header = torch.zeros(HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    return [dist.isend(t, dst, group, tag=TAG) for t in (header, tensor)]


def recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Receive a tensor `send_tensor` sent from global rank `src`."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group, tag=TAG)
    ndim = int(header[0])
    shape = torch.Size(header[2 : 2 + ndim].tolist())
    tensor = torch.empty(shape, dtype=DTYPES[int(header[1])], device=device)
    dist.recv(tensor, src, group, tag=TAG)
    return tensor


@torch.no_grad()
def forward_only(
    chunks: Sequence[nn.Module],
    stages: Sequence[int],
    owners: Sequence[int],
    inputs: Sequence[torch.Tensor],
    kwargs: Sequence[dict[str, torch.Tensor]],
    loss_of: Callable[[torch.Tensor, int], torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> list[torch.Tensor]:
    """Run every micro-batch through this rank's `chunks` (stages `stages`, in model order);
    returns the loss of each micro-batch where this rank holds the last stage, else [].

    `owners[s]`: the pipeline rank (in `group`) that holds stage s. `inputs[i]`, `kwargs[i]`:
    micro-batch i's tokens (read by stage 0) and the keyword arguments of every stage's
    forward (the document ids). `loss_of(output, i)`: the last stage's loss of micro-batch i.
    """
    me, last = dist.get_rank(group), len(owners) - 1
    handed: dict[tuple[int, int], torch.Tensor] = {}  # to a later stage of this rank
    sends: list[dist.Work] = []
    losses = []
    for chunk, stage in zip(chunks, stages, strict=True):
        for i, kw in enumerate(kwargs):
            if stage == 0:
                x = inputs[i]
            elif owners[stage - 1] == me:
                x = handed.pop((stage, i))
            else:
                x = recv_tensor(dist.get_global_rank(group, owners[stage - 1]), group, device)
            out = chunk(x, **kw)
            if stage == last:
                losses.append(loss_of(out, i))
            elif owners[stage + 1] == me:
                handed[(stage + 1, i)] = out
            else:
                dst = dist.get_global_rank(group, owners[stage + 1])
                sends += send_tensor(out, dst, group)
    for work in sends:
        work.wait()
    return losses
