"""Materialize a meta-device model and give it the same weights under every layout.

Every parameter's full value comes from `pretrain.models.init.initial_value(name, seed)`; a sharded
(DTensor) parameter keeps only its own slice of it, so DP, ZeRO and TP runs all start from
the weights of the single-device run. Vocabulary rows that tensor parallelism adds for
padding are zeros after the real ones, which keep their unpadded values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain.core.model_config import ModelConfig
from pretrain.models.init import initial_value
from pretrain.parallel.tensor import VOCAB_PARAMS


@torch.no_grad()
def materialize(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    param_device: torch.device | None = None,
) -> None:
    """Allocate storage on `device` (parameters on `param_device` where they are offloaded
    to the host) and fill parameters and buffers deterministically."""
    model.to_empty(device=param_device or device)
    for name, param in model.named_parameters():
        full = _initial_value(cfg, name, tuple(param.shape), seed).to(device)
        if isinstance(param, DTensor):
            # Every rank computed the same full tensor: slice locally, no communication.
            local = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    model.init_buffers(device)


def _initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial tensor; padded vocabulary rows are zeros after the real ones."""
    if name not in VOCAB_PARAMS or shape[0] <= cfg.vocab_size:
        return initial_value(cfg, name, shape, seed)
    real = initial_value(cfg, name, (cfg.vocab_size, *shape[1:]), seed)
    return torch.cat([real, real.new_zeros(shape[0] - cfg.vocab_size, *shape[1:])])
