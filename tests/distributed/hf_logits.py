"""Under torchrun: build a run's model under its layout with init.from_hf, and save the
logits of fixed tokens (gathered from the tensor-parallel shards) from rank 0.

    torchrun --nproc-per-node N -m tests.distributed.hf_logits RUN_DIR/config.yaml OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallel.mesh import build_mesh
from pretrain_core.layout import resolve_degrees
from pretrain_core.schema import load_config
from trainer.build import build_train_state
from trainer.checkpoint.hf_import import load_hf_weights
from trainer.dist import init_distributed

TOKENS = torch.tensor([[5, 17, 300, 42, 7, 7, 120, 3], [1, 2, 3, 4, 5, 6, 7, 8]])


def main(config_path: str, out: str) -> None:
    cfg = load_config(config_path)
    rank = init_distributed(cfg.cluster)
    degrees = resolve_degrees(cfg)
    state = build_train_state(cfg, build_mesh(degrees, rank.device.type), rank.device)
    load_hf_weights(state.plain, cfg.model, cfg.init.from_hf)
    with torch.no_grad():
        logits = state.model(TOKENS)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if rank.is_main:
        torch.save(logits[..., : cfg.model.vocab_size].clone(), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
