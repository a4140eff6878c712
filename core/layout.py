"""Parallel layout: degrees resolved from the world size, and which ranks form each group.

The mesh's dims are, outer to inner, (pp, dp_replicate, dp_shard, cp, tp), laid over global
ranks in row-major order: tp is innermost, so a TP group is consecutive ranks of one node,
and cp next to it, so a context-parallel ring stays in a node as long as tp*cp fits one.
Context-parallel ranks read the same sequences (each its own chunks of them) but hold the
same weights, so they join the data-parallel gradient reduction (`dp_cp`). The trainer
builds its DeviceMesh from the same `resolve_degrees`, so the plan and the run agree on
every group.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from pretrain.core.problems import Problem, RecipeError, divisors, nearby_multiples, or_list
from pretrain.core.schema import ParallelConfig, RecipeConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dims, outer to inner."""


@dataclass(frozen=True)
class Degrees:
    """Resolved parallel degrees; pp * dp_replicate * dp_shard * cp * tp == world."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    world: int
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence."""
    etp: int = 1
    """Expert tensor-parallel degree: ranks of a tp group that split each expert (divides tp)."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_replicas(self) -> int:
        """Ranks that reduce each gradient together: data parallelism times context
        parallelism (the cp ranks of one sequence hold the same weights)."""
        return self.dp * self.cp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        """Sizes of the mesh dims in `MESH_DIMS` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)


def uses_fsdp(parallel: ParallelConfig, degrees: Degrees) -> bool:
    """Whether FSDP2 holds the parameters: ZeRO-2/3 with more than one rank reducing
    gradients (data- or context-parallel), or with parallel.offload, which moves FSDP2's
    shards to the host even when a single rank holds them all."""
    return parallel.zero >= 2 and (degrees.grad_replicas > 1 or parallel.offload != "none")


def world_size(cfg: RecipeConfig) -> int:
    """Ranks in the job: nodes times ranks per node."""
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def resolve_degrees(cfg: RecipeConfig) -> Degrees:
    """The degrees of `cfg` with dp_shard=-1 filled from the world size.

    Raises RecipeError (naming `parallel.dp_shard`) when the degrees cannot tile the world.
    """
    p = cfg.parallel
    world = world_size(cfg)
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    if min(p.pp, p.dp_replicate, p.cp, p.tp, p.ep, world) < 1 or (
        p.dp_shard < 1 and p.dp_shard != -1
    ):
        _fail(
            p.dp_shard,
            f"degrees pp={p.pp}, dp_replicate={p.dp_replicate}, dp_shard={p.dp_shard}, "
            f"cp={p.cp}, tp={p.tp}, ep={p.ep} and world size {world} must be positive "
            "(dp_shard may be -1)",
            "use positive degrees; dp_shard=-1 fills the rest of the world",
        )
    where = f"{cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s)"
    product_of = f"{p.pp}*{p.dp_replicate}*{p.cp}*{p.tp}"
    if p.dp_shard == -1:
        if world % fixed:
            _fail(
                p.dp_shard,
                f"the world size {world} ({where}) is not divisible by pp*dp_replicate*cp*tp = "
                f"{product_of} = {fixed}",
                f"choose pp*dp_replicate*cp*tp among the divisors of {world}: "
                f"{or_list(divisors(world))}",
            )
        return Degrees(p.pp, p.dp_replicate, world // fixed, p.tp, p.ep, world, p.cp, p.etp)
    if fixed * p.dp_shard != world:
        fill = f"dp_shard={world // fixed} or -1" if world % fixed == 0 else "-1 after fixing tp/pp"
        _fail(
            p.dp_shard,
            f"pp*dp_replicate*dp_shard*cp*tp = {p.pp}*{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp}"
            f" = {fixed * p.dp_shard} but the world size is {world} ({where})",
            f"set parallel.{fill}, or change cluster.nodes/gpus_per_node",
        )
    return Degrees(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.ep, world, p.cp, p.etp)


def _fail(value: object, reason: str, fix: str, field: str = "parallel.dp_shard") -> None:
    raise RecipeError([Problem(field, value, reason, fix)])


def rank_groups(degrees: Degrees) -> dict[str, list[list[int]]]:
    """Global ranks of every group along each mesh dim, plus `dp`, `dp_cp`, `ep` and `etp`.

    `dp` joins dp_replicate and dp_shard (the ranks that read different sequences); `dp_cp`
    adds cp to them (gradient reduction spans all three); `ep` splits each dp group into
    consecutive chunks of ep members (expert parallelism borrows dp ranks); `etp` splits each
    tp group into consecutive chunks of etp members (expert tensor parallelism borrows tp
    ranks).
    """
    shape = degrees.mesh_shape
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]

    def groups_along(dims: tuple[int, ...]) -> list[list[int]]:
        others = [i for i in range(len(shape)) if i not in dims]
        result = []
        for fixed in product(*(range(shape[i]) for i in others)):
            base = sum(c * strides[i] for c, i in zip(fixed, others, strict=True))
            members = product(*(range(shape[i]) for i in dims))
            result.append(
                [base + sum(c * strides[i] for c, i in zip(m, dims, strict=True)) for m in members]
            )
        return result

    groups = {name: groups_along((i,)) for i, name in enumerate(MESH_DIMS)}
    groups["dp"] = groups_along((1, 2))
    groups["dp_cp"] = groups_along((1, 2, 3))
    groups["ep"] = [
        g[i : i + degrees.ep] for g in groups["dp"] for i in range(0, len(g), degrees.ep)
    ]
    groups["etp"] = [
        g[i : i + degrees.etp] for g in groups["tp"] for i in range(0, len(g), degrees.etp)
    ]
    return groups


def grad_accum_steps(cfg: RecipeConfig) -> int:
    """Micro-batches each rank runs per optimizer step: global / (micro_batch * dp).

    Raises RecipeError naming `train.micro_batch` when one pass over the dp ranks is already
    more than the global batch, and `train.global_batch` when the division leaves a remainder.
    """
    micro, dp, batch = cfg.train.micro_batch, resolve_degrees(cfg).dp, cfg.train.global_batch
    per_pass = micro * dp
    if 1 <= batch < per_pass:
        # One pass of micro-batches over the dp ranks already holds more than the whole batch.
        fits = [m for m in range(1, micro) if batch % (m * dp) == 0]
        _fail(
            micro,
            f"micro_batch*dp = {micro}*{dp} = {per_pass} sequences per pass is more than "
            f"train.global_batch={batch}",
            f"use train.micro_batch={or_list(fits[-2:])}"
            if fits
            else f"use train.global_batch >= {per_pass}",
            field="train.micro_batch",
        )
    if per_pass < 1 or batch < 1 or batch % per_pass:
        _fail(
            batch,
            f"not divisible by micro_batch*dp = {micro}*{dp} = {per_pass}",
            f"use a multiple of {per_pass}, e.g. {or_list(nearby_multiples(batch, per_pass))}",
            field="train.global_batch",
        )
    return batch // per_pass


def ep_nodes(ep: int, stride: int, gpus_per_node: int) -> int | None:
    """Nodes one group of `ep` ranks `stride` (tp x cp) apart spans, each holding the same
    share of its ranks (so of the experts), or None when it splits unevenly over nodes.

    The ep members are tp x cp ranks apart (`rank_groups`), and a group starts at a
    multiple of ep x tp x cp, so member i sits on the group's node i // (members per node).
    """
    if stride % gpus_per_node == 0:
        return ep  # every member on nodes of its own
    if gpus_per_node % stride:
        return None
    per_node = gpus_per_node // stride
    if ep <= per_node:
        return 1 if per_node % ep == 0 else None
    return ep // per_node if ep % per_node == 0 else None


def expert_node_groups(cfg: RecipeConfig) -> int:
    """Expert groups the router limits each token to `model.moe_node_limit` of: the model's
    `moe_groups`, else one per node the ep group spans (1 without the limit, or when
    validation would refuse it)."""
    if cfg.model.moe_node_limit < 1:
        return 1
    if cfg.model.moe_groups > 0:
        return cfg.model.moe_groups
    p = cfg.parallel
    return ep_nodes(p.ep, p.tp * p.cp, cfg.cluster.gpus_per_node) or 1
