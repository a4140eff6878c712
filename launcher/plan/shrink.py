"""The layouts a SLURM job continues with after losing nodes (`cluster.min_nodes`).

For each node count from min_nodes to nodes - 1, chosen at submission so that the job needs
no launcher when it shrinks: first the recipe's own degrees with data parallelism filling
what is left (the global batch kept, so a rank accumulates more micro-batches), then the
same with hybrid sharding's replica groups folded into one, then (on GPUs) the planner's
fastest layout for that many nodes. Each candidate passes the launcher's validation and
memory check, and changes only what a resumed run may change; the job script picks the one
for the nodes it keeps (`config.nodes-N.yaml`, core/run/rundir.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

from pretrain.core.problems import Problem, RecipeError
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.plan.memory_fit import check_fits
from pretrain.launcher.validate.recipe import validate
from pretrain.launcher.validate.resume import frozen_changes


def shrinks(cfg: RecipeConfig) -> bool:
    """Whether the job continues on fewer nodes when it loses some."""
    k = cfg.cluster
    return k.backend == "slurm" and 0 < k.min_nodes < k.nodes


def _candidates(cfg: RecipeConfig, nodes: int) -> Iterator[tuple[str, RecipeConfig]]:
    """(how it was chosen, the recipe on `nodes` nodes), in order of preference."""
    same = copy.deepcopy(cfg)
    same.cluster.nodes = nodes
    same.parallel.dp_shard = -1
    yield "the same degrees, data parallelism over the ranks left", same
    if cfg.parallel.dp_replicate > 1:
        folded = copy.deepcopy(same)
        folded.parallel.dp_replicate = 1
        yield "the same degrees, one sharding group over the ranks left", folded
    if cfg.cluster.device == "cuda":
        from pretrain.launcher.plan.suggest import search

        try:
            found = search(same, top=1).suggestions
        except RecipeError:
            return
        if found:
            yield "the planner's fastest layout for them", found[0].layout.apply(same)


def _accepted(cfg: RecipeConfig, candidate: RecipeConfig) -> bool:
    try:
        validate(candidate, for_launch=True)
        check_fits(candidate)
    except RecipeError:
        return False
    return not frozen_changes(dump_config(cfg), dump_config(candidate))


def shrunk_recipes(
    cfg: RecipeConfig, accepted: Callable[[RecipeConfig, RecipeConfig], bool] = _accepted
) -> dict[int, tuple[RecipeConfig, str]]:
    """For each node count from cluster.min_nodes to nodes - 1: the recipe the job continues
    with and how it was chosen. Raises RecipeError naming cluster.min_nodes when a count
    has no layout that fits."""
    if not shrinks(cfg):
        return {}
    chosen: dict[int, tuple[RecipeConfig, str]] = {}
    for nodes in range(cfg.cluster.min_nodes, cfg.cluster.nodes):
        for how, candidate in _candidates(cfg, nodes):
            if accepted(cfg, candidate):
                chosen[nodes] = (candidate, how)
                break
        else:
            planner = " nor the planner's fastest layout" if cfg.cluster.device == "cuda" else ""
            raise RecipeError(
                [
                    Problem(
                        "cluster.min_nodes",
                        cfg.cluster.min_nodes,
                        f"no layout of this recipe runs on {nodes} node(s) of "
                        f"{cfg.cluster.gpus_per_node}: neither its own degrees with less data "
                        f"parallelism{planner} pass validation and fit in memory",
                        f"raise cluster.min_nodes above {nodes}, or 0 to fail on a lost node "
                        f"(`pretrain ... cluster.nodes={nodes} action=plan` shows why)",
                    )
                ]
            )
    return chosen


def shrink_summary(cfg: RecipeConfig) -> list[str]:
    """One line per node count the job may shrink to, for the plan."""
    lines = []
    for nodes, (shrunk, how) in shrunk_recipes(cfg).items():
        p = shrunk.parallel
        degrees = f"tp{p.tp} pp{p.pp} cp{p.cp} ep{p.ep} dp_shard {p.dp_shard} (-1: the rest)"
        lines.append(f"on {nodes} node(s): {degrees}, micro-batch {shrunk.train.micro_batch}; "
                     f"{how}")  # fmt: skip
    return lines
