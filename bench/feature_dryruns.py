"""Dry-run one layout per frontier MoE and precision feature (expert tensor parallelism,
multi-token prediction, block-scaled FP8, node-limited routing, distributed Muon) at the
harness model's shapes, and print the plan beside the measurement, as
`bench/dryrun_recipes.py` does for the shipped recipes (in MiB): rank, plan, dry run,
plan / dry run, the step's collective bytes per kind (the cost model's and the dry run's),
then each layout's figures by category.

    python bench/feature_dryruns.py [FEATURE ...]

The layouts are those the parity tests train (tests/distributed/), at a longer sequence so
that activations weigh beside the weights. The dry run runs the job's device type: `cpu`
here, so every figure is the CPU trainer's (no framework allowance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dryrun_recipes import print_table, recipe

HARNESS = [
    "model.vocab_size=512", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=192", "model.n_layers=4", "train.seq_len=256", "train.micro_batch=2",
]  # fmt: skip
"""The harness model (tests/distributed/harness.py), at 256-token sequences."""
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=96"]
EMULATED = ["precision.fp8_backend=torchao", "precision.fp8_emulate=true"]
MIB = 2**20

FEATURES: dict[str, tuple[str, list[str]]] = {
    "etp (tp2 sp, ep2 etp2, ZeRO-2 over 2; 8 ranks)": (
        "tiny_moe",
        [*MOE, "parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=2",
         "parallel.zero=2", "cluster.gpus_per_node=8", "train.global_batch=16"],
    ),
    "mtp 2 depths (pp2 tp2 sp, chunked loss; 4 ranks)": (
        "tiny",
        ["model.mtp_layers=2", "parallel.pp=2", "parallel.tp=2", "parallel.sp=true",
         "train.loss_chunks=4", "cluster.gpus_per_node=4", "train.global_batch=8"],
    ),
    "mtp 1 depth (pp2 DualPipeV, ZeRO-2; 2 ranks)": (
        "tiny",
        ["model.mtp_layers=1", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev",
         "parallel.zero=2", "recompute.policy=full", "cluster.gpus_per_node=2",
         "train.global_batch=8"],
    ),
    "mxfp8 experts and linears (ep2, ZeRO-2 over 4; 4 ranks)": (
        "tiny_moe",
        [*MOE, "precision=fp8", *EMULATED, "precision.fp8_recipe=mxfp8",
         "model.dim=128", "model.ffn_dim=256", "model.moe_ffn_dim=128", "parallel.ep=2",
         "parallel.zero=2", "cluster.gpus_per_node=4", "train.global_batch=8"],
    ),
    "blockwise fp8 (ZeRO-2 over 4; 4 ranks)": (
        "tiny",
        ["precision=fp8", *EMULATED, "precision.fp8_recipe=blockwise", "model.dim=256",
         "model.ffn_dim=512", "parallel.zero=2", "cluster.gpus_per_node=4",
         "train.global_batch=8"],
    ),
    "node-limited routing (ep4 over 2 nodes, 2 of 4 groups, at most 1 node; 8 ranks)": (
        "tiny_moe",
        [*MOE, "model.moe_experts=8", "model.moe_groups=4", "model.moe_node_limit=1",
         "parallel.ep=4", "parallel.zero=2", "cluster.nodes=2", "cluster.gpus_per_node=4",
         "train.global_batch=16"],
    ),
    "distributed muon (ZeRO-2 over 4; 4 ranks)": (
        "tiny",
        ["optim.name=muon", "parallel.zero=2", "cluster.gpus_per_node=4",
         "train.global_batch=8"],
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("features", nargs="*", help="substrings of the layouts to run")
    args = parser.parse_args()
    layouts = (
        (label, recipe(name, [*HARNESS, "cluster.device=cpu", *overrides]))
        for label, (name, overrides) in FEATURES.items()
        if not args.features or any(f in label for f in args.features)
    )
    print_table("feature and layout", layouts, unit=MIB)


if __name__ == "__main__":
    main()
