"""Saved-activation bytes per rank under context parallelism, on a long sequence.

For cp = 1, 2, 4 (gloo processes on CPU, FP32) the real model runs its forward on this
rank's head and tail chunks of one 8192-token sequence, with every block's attention core
swapped for the ring (`pretrain.parallel.context.apply_context_parallel`). Every tensor autograd
saves is counted once (by storage), parameters excluded: per block (its forward only) and
for the whole forward (embedding, blocks, final norm and the logits of the LM head). The
largest rank's figure is reported beside cp=1's and beside the memory model's per-block
bytes for s/cp tokens (`pretrain.launcher.plan.memory.llama_block_activations`), which the plan
uses.

At cp=1 attention is the CPU flash kernel of SDPA, which saves q, k, v, its output and a
log-sum-exp per head and token; the ring saves the same tensors for this rank's tokens, so
every saved tensor holds s/cp tokens and the ratio should be 1/cp.

Run: python bench/cp_activation_memory.py [--cp 1,2,4] (spawns its own processes; a few
minutes).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain import models
from pretrain.core.layout import Degrees
from pretrain.core.model_config import ModelConfig
from pretrain.launcher.plan.memory import llama_block_activations
from pretrain.parallel.context import apply_context_parallel, shard_sequence
from pretrain.parallel.materialize import materialize
from pretrain.parallel.mesh import build_mesh

MODEL = ModelConfig(
    vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=8192
)
SEQ, BATCH = 8192, 1


def saved_bytes(cp: int) -> tuple[int, int]:
    """(bytes saved per block, bytes saved by the whole forward) on this rank."""
    world = Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=1, ep=1, world=cp, cp=cp)
    mesh = build_mesh(world, "cpu")
    model = models.build(MODEL)
    apply_context_parallel(model, mesh)
    materialize(model, MODEL, seed=0, device=torch.device("cpu"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    in_block = [False]
    blocks: dict[int, int] = {}
    everything: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            everything[storage.data_ptr()] = storage.nbytes()
            if in_block[0]:
                blocks[storage.data_ptr()] = storage.nbytes()
        return t

    for block in model.layers.values():
        block.register_forward_pre_hook(lambda *_: in_block.__setitem__(0, True))
        block.register_forward_hook(lambda *_: in_block.__setitem__(0, False))
    tokens = torch.randint(
        0, MODEL.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    local = shard_sequence(tokens, cp, mesh.world["cp"].get_local_rank()) if cp > 1 else tokens
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(local)
    logits.float().sum().backward()  # the ring's backward runs too (not measured)
    return sum(blocks.values()) // MODEL.n_layers, sum(everything.values())


def _worker(rank: int, cp: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.set_num_threads(1)
    per_block, total = saved_bytes(cp)
    gathered: list = [None] * cp
    dist.all_gather_object(gathered, (per_block, total))
    if rank == 0:
        results[cp] = (max(b for b, _ in gathered), max(t for _, t in gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", default="1,2,4", help="degrees to measure, 1 first")
    degrees = [int(c) for c in parser.parse_args().cp.split(",")]
    results = mp.Manager().dict()
    for i, cp in enumerate(degrees):
        mp.spawn(_worker, args=(cp, 29650 + i, results), nprocs=cp)
    base_block, base_total = results[1]
    print(
        f"model: h={MODEL.dim} a={MODEL.n_heads} kv_heads={MODEL.kv_heads} ffn={MODEL.ffn_dim}, "
        f"{MODEL.n_layers} layers, s={SEQ} b={BATCH}, fp32, torch {torch.__version__}; "
        "MiB per rank (the largest rank)"
    )
    print(
        "| cp | per block | memory model per block | measured / model | per block / cp=1 "
        "| whole forward | whole forward / cp=1 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cp, (block, total) in sorted(results.items()):
        model = llama_block_activations(MODEL, SEQ // cp, BATCH, 4, 4, 1, False, "none")
        print(
            f"| {cp} | {block / 2**20:.2f} | {model / 2**20:.2f} | {block / model:.3f} "
            f"| {block / base_block:.3f} | {total / 2**20:.2f} | {total / base_total:.3f} |"
        )


if __name__ == "__main__":
    main()
