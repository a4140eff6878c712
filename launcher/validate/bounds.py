"""Upper bounds of the counts a recipe gives: model sizes, parallel degrees and counts
the planner walks one by one.

A count far beyond any model or cluster is a typo (`model.moe_experts=1000000007`) or a
probe, never a run: the planner would walk it (a pipeline of 10^8 layers takes minutes
to split) and the ranks would allocate it (an expert table of 10^9 experts) before any
prediction is compared with the device. Each bound is a few times the largest value a
published model or cluster uses, and its reason says what it measures.
"""

from __future__ import annotations

from pretrain.core.problems import Checks
from pretrain.core.schema import RecipeConfig

MAX_WORLD = 2**18
"""Ranks in a job (cluster.nodes x cluster.gpus_per_node): the largest clusters have about
100,000 GPUs, and the planner lists every rank's groups."""
BOUNDS: dict[str, tuple[int, str]] = {
    "model.n_layers": (2048, "layers; the deepest published models have about 200"),
    "model.dim": (2**17, "model width; the widest published models use about 25,000"),
    "model.ffn_dim": (2**20, "MLP width; published models use at most about 100,000"),
    "model.moe_ffn_dim": (2**20, "expert MLP width; published models use at most 25,000"),
    "model.n_heads": (4096, "query heads; published models use at most about 256"),
    "model.n_kv_heads": (4096, "key/value heads; never more than the query heads"),
    "model.head_dim": (4096, "a head's width; published models use at most 256"),
    "model.vocab_size": (2**24, "tokens; the largest published vocabularies are about 1M"),
    "model.max_seq_len": (2**24, "positions (the RoPE table has one row each); the longest "
                          "published contexts are about 10M"),
    "model.moe_experts": (2**14, "routed experts; published models route over at most 256 "
                          "and the ranks build every one"),
    "model.moe_shared_experts": (64, "shared experts; published models use 1 or 2"),
    "model.mla_q_rank": (2**17, "MLA's query rank; never above model.dim"),
    "model.mla_kv_rank": (2**17, "MLA's key/value rank; never above model.dim"),
    "model.sliding_window": (2**24, "positions in the attention window"),
    "model.mtp_layers": (64, "multi-token prediction depths; DeepSeek-V3 uses 1"),
    "parallel.pp_microbatches": (2**16, "micro-batches per step; the schedule simulator "
                                 "walks every one of every stage"),
    "parallel.vpp": (2048, "model chunks per pipeline rank; no more than the layers"),
    "parallel.tp": (4096, "tensor-parallel ranks; no more than the heads"),
    "parallel.cp": (2**16, "context-parallel ranks"),
    "parallel.pp": (2048, "pipeline stages; no more than the layers"),
    "parallel.ep": (2**14, "expert-parallel ranks; no more than the experts"),
    "parallel.etp": (4096, "expert tensor-parallel ranks; no more than the tp ranks"),
    "parallel.dp_replicate": (MAX_WORLD, "data-parallel replicas; no more than the ranks"),
    "parallel.dp_shard": (MAX_WORLD, "data-parallel shards; no more than the ranks"),
    "cluster.nodes": (2**16, "nodes; the largest clusters have a few tens of thousands"),
    "cluster.gpus_per_node": (1024, "ranks per node; a GPU node has 4 to 16"),
    "cluster.omp_num_threads": (1024, "threads per rank; no node has more cores"),
    "cluster.cpus_per_task": (2**16, "CPUs per node's task; no node has more"),
    "cluster.max_restarts": (100, "restarts of the whole job; a failure that repeats would "
                             "restart it this many times"),
    "eval.batches": (2**20, "batches per validation; every one is run at each evaluation"),
}  # fmt: skip
"""Field -> (largest value accepted, what the field counts and why that is generous)."""


def check_bounds(c: Checks, cfg: RecipeConfig) -> bool:
    """Refuse every count over its bound; True when all are within theirs."""
    ok = True
    for path, (limit, why) in BOUNDS.items():
        section, name = path.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            c.add(path, value, f"more than {limit:,} {why}",
                  f"use a value <= {limit:,}; a typo of a digit is the usual cause")  # fmt: skip
            ok = False
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    if ok and world > MAX_WORLD:
        c.add("cluster.nodes", cfg.cluster.nodes, f"x cluster.gpus_per_node="
              f"{cfg.cluster.gpus_per_node} is {world:,} ranks, more than the {MAX_WORLD:,} of "
              "the largest clusters (the planner lists every rank's groups)",
              "use fewer nodes or ranks per node")  # fmt: skip
        ok = False
    return ok
