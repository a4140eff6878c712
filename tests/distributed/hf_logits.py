"""Under torchrun: build each run's model under its layout with init.from_hf, and save the
logits of fixed tokens (gathered from the tensor-parallel shards, or computed stage by stage
through the pipeline) from the rank that holds them, one list entry per config. Without a
pipeline, the gradients of the per-head query/key norm weights (which every tensor-parallel
rank holds whole but applies to its own heads only) and of latent attention's latent norms
(replicated over tensor parallelism) of loss_of(logits) come with them, by Hugging Face name.

    torchrun --nproc-per-node N -m tests.distributed.hf_logits OUT.pt RUN_DIR/config.yaml ...

Several checkpoints share one launch: each config is built, loaded and run in turn. All of
them must have the same layout (the process group is joined once).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pretrain.core.hf.llama import hf_names
from pretrain.core.layout import resolve_degrees
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.parallel.mesh import build_mesh
from pretrain.trainer.build import build_train_state
from pretrain.trainer.checkpoint.hf_import import load_hf_weights
from pretrain.trainer.dist import init_distributed

TOKENS = torch.tensor([[5, 17, 300, 42, 7, 7, 120, 3], [1, 2, 3, 4, 5, 6, 7, 8]])


def loss_of(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A loss every logit enters: the mean square of the (unpadded) logits."""
    return logits[..., :vocab_size].float().pow(2).mean()


def logits_of(
    cfg: RecipeConfig, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """The logits of TOKENS under `cfg`'s layout on the rank that holds them, and the norm
    gradients the module names; None elsewhere. Under pp (one chunk per rank) the hidden
    states go stage to stage by send/recv, and no gradient is taken."""
    degrees = resolve_degrees(cfg)
    mesh = build_mesh(degrees, device.type)
    state = build_train_state(cfg, mesh, device)
    load_hf_weights(state.plain, cfg.model, cfg.init.from_hf)
    if degrees.pp == 1:
        logits = state.model(TOKENS)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss_of(logits, cfg.model.vocab_size).backward()
        grads = {
            hf_names(name, cfg.model)[0]: param.grad.clone()
            for name, param in state.plain.named_parameters()
            if name.endswith(("q_norm.weight", "k_norm.weight", "kv_norm.weight"))
        }
        return (logits.detach(), grads) if dist.get_rank() == 0 else None
    with torch.no_grad():
        return _pipelined(cfg, mesh, degrees.pp, state.model)


def _pipelined(cfg: RecipeConfig, mesh, pp: int, model) -> tuple[torch.Tensor, dict] | None:
    stage, last = mesh.world["pp"].get_local_rank(), pp - 1
    group = mesh.world["pp"].get_group()
    (chunk,) = model
    if stage == 0:
        h = TOKENS
    else:
        h = torch.empty(*TOKENS.shape, cfg.model.dim)
        dist.recv(h, group=group, group_src=stage - 1)
    out = chunk(h)
    if stage < last:
        dist.send(out.contiguous(), group=group, group_dst=stage + 1)
        return None
    return out, {}


def main(out: str, config_paths: list[str]) -> None:
    configs = [load_config(path) for path in config_paths]
    rank = init_distributed(configs[0].cluster)
    found = [logits_of(cfg, rank.device) for cfg in configs]
    if found[0] is not None:
        vocab = [cfg.model.vocab_size for cfg in configs]
        kept = [(f[0][..., :v].clone(), f[1]) for f, v in zip(found, vocab, strict=True)]
        torch.save(kept, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
