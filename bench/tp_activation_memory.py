"""Saved-activation bytes per rank and layer under tensor parallelism, with and without SP.

For TP = 1, 2, 4 (gloo processes on CPU, FP32) the model's forward runs under
saved-tensor hooks; every tensor autograd saves while a block runs is counted once (by
storage), parameters excluded, and the sum is divided by the number of blocks. The figures
are compared with Korthikanti et al. (2022), whose per-layer bytes are, for a GPT block in
16-bit with dropout, sbh(10 + 24/t + 5as/(ht)) with TP and (sbh/t)(34 + 5as/h) with SP.

Adjusted to this model (FP32, no dropout, RMSNorm, GQA, SwiGLU, fused attention), the
elements each block saves are, with k = kv heads x head_dim and f = ffn_dim:
- each RMSNorm: its input, its normalized value (for the weight's gradient) and its output
  (the input of the next projections): 3sbh, replicated over TP (the literature's 10 counts
  the norm inputs, the projection inputs and two dropout masks);
- attention: rotated Q, rotated K, V and the output the fused kernel saves (wo reads that
  output through a view, so it is not saved twice): sbh(2 + 2k/h)/t; the fused kernel keeps
  a log-sum-exp of a*s*b instead of the a*s*s*b scores, so the literature's 5as/h term
  becomes a/h;
- SwiGLU: gate, up, silu(gate) and their product: 4sbf/t.
So without SP: 4 B x sbh(6 + (2 + 2k/h + 4f/h + a/h)/t). With SP, DTensor keeps each norm's
input and normalized value sequence-sharded (2sbh/t per norm) but each column-wise
projection saves its all-gathered input (sbh per norm, replicated):
4 B x sbh(2 + (6 + 2k/h + 4f/h + a/h)/t). Megatron-LM re-gathers that input in backward
instead of saving it, which is what gives the literature's pure 1/t.

Run: python bench/tp_activation_memory.py (spawns its own processes; about a minute).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from pretrain import models
from pretrain.core.layout import Degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import ParallelConfig
from pretrain.parallel.materialize import materialize
from pretrain.parallel.mesh import build_mesh
from pretrain.parallel.tensor import apply_tensor_parallel

MODEL = ModelConfig(
    vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512
)
SEQ, BATCH = 512, 2


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    # A collective's result is a wrapper until waited on; its storage is the waited tensor's.
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def saved_bytes_per_layer(tp: int, sp: bool) -> int:
    """Bytes autograd saves per block on this rank (needs an initialized process group)."""
    mesh = build_mesh(Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=tp, ep=1, world=tp), "cpu")
    model = models.build(MODEL)
    apply_tensor_parallel(model, mesh, ParallelConfig(tp=tp, sp=sp))
    materialize(model, MODEL, seed=0, device=torch.device("cpu"))
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    for block in model.layers.values():
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = torch.randint(
        0, MODEL.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(storages.values()) // MODEL.n_layers


def predicted(tp: int, sp: bool) -> tuple[float, float]:
    """(literature in FP32, this model's adjusted formula) bytes per layer."""
    s, b, h, a = SEQ, BATCH, MODEL.dim, MODEL.n_heads
    k, f = MODEL.kv_heads * MODEL.head_dim, MODEL.ffn_dim
    sbh = s * b * h
    if sp:
        literature = sbh / tp * (34 + 5 * a * s / h)
        adjusted = sbh * (2 + (6 + 2 * k / h + 4 * f / h + a / h) / tp)
    else:
        literature = sbh * (10 + 24 / tp + 5 * a * s / (h * tp))
        adjusted = sbh * (6 + (2 + 2 * k / h + 4 * f / h + a / h) / tp)
    return 2 * literature, 4 * adjusted


def _worker(rank: int, tp: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    torch.set_num_threads(1)
    for sp in (False, True) if tp > 1 else (False,):
        measured = saved_bytes_per_layer(tp, sp)
        if rank == 0:
            results[(tp, sp)] = measured
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    results = mp.Manager().dict()
    for i, tp in enumerate((1, 2, 4)):
        mp.spawn(_worker, args=(tp, 29610 + i, results), nprocs=tp)
    base = results[(1, False)]
    print(
        f"model: h={MODEL.dim} a={MODEL.n_heads} kv_heads={MODEL.kv_heads} ffn={MODEL.ffn_dim}, "
        f"s={SEQ} b={BATCH}, fp32; MiB per layer per rank"
    )
    print(
        "| tp | sp | measured | adjusted formula | measured / adjusted | literature (x2 for fp32) "
        "| measured / tp=1 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (tp, sp), measured in sorted(results.items()):
        literature, adjusted = predicted(tp, sp)
        print(
            f"| {tp} | {'on' if sp else 'off'} | {measured / 2**20:.2f} | {adjusted / 2**20:.2f} "
            f"| {measured / adjusted:.3f} | {literature / 2**20:.2f} | {measured / base:.3f} |"
        )


if __name__ == "__main__":
    main()
