"""Recipe rules for mixture-of-experts models and expert parallelism (no torch here)."""

from __future__ import annotations

from pretrain.core.layout import ep_nodes, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import Checks, RecipeError, divisors, or_list
from pretrain.core.schema import RecipeConfig


def moe_layers_problem(policy: str, n_layers: int) -> str | None:
    """Why `model.moe_layers` is not a policy for `n_layers` layers, or None when it is."""
    name, sep, arg = policy.partition(":")
    if name == "all" and not sep:
        return None
    if name not in ("every", "after") or not arg.isdigit():
        return "not a layer policy"
    if name == "every" and not 1 <= int(arg) <= n_layers:
        return f"every:K needs 1 <= K <= n_layers={n_layers}"
    if name == "after" and int(arg) >= n_layers:
        return f"after:N leaves no MoE layer of {n_layers}"
    return None


def check_moe(c: Checks, cfg: RecipeConfig, for_launch: bool) -> None:
    """Every MoE or expert-parallel rule `cfg` breaks (the router's choices are the schema's).

    ep > 1 on a dense model can be planned (the EP groups are shown) but not launched.
    """
    m, ep = cfg.model, cfg.parallel.ep

    def add(field: str, value: object, reason: str, fix: str) -> None:
        c.add(f"model.{field}" if "." not in field else field, value, reason, fix)

    for name in ("moe_node_limit", "moe_groups"):
        if getattr(m, name) and m.moe_experts <= 0:
            add(
                name,
                getattr(m, name),
                "group-limited routing needs a mixture-of-experts model (model.moe_experts=0)",
                f"set model.{name}=0, or model.moe_experts > 0",
            )
    if m.moe_shared_gate and m.moe_shared_experts <= 0:
        add(
            "moe_shared_gate",
            True,
            "gates the shared experts' output, and this model has none (moe_shared_experts="
            f"{m.moe_shared_experts})",
            "set model.moe_shared_gate=false, or model.moe_shared_experts >= 1",
        )
    if m.moe_experts < 0:
        add("moe_experts", m.moe_experts, "must be >= 0", "use 0 (dense) or the number of experts")
        return
    if m.moe_experts == 0:
        if ep > 1 and for_launch:
            add(
                "parallel.ep",
                ep,
                "expert parallelism needs a mixture-of-experts model (model.moe_experts=0)",
                "set parallel.ep=1, or model.moe_experts to a multiple of ep",
            )
        if cfg.parallel.etp > 1 and for_launch:
            add(
                "parallel.etp",
                cfg.parallel.etp,
                "expert tensor parallelism splits the experts of a mixture-of-experts model "
                "(model.moe_experts=0)",
                "set parallel.etp=1 (parallel.tp splits a dense model's MLP)",
            )
        return
    _check_routing_numbers(c, m)
    if m.n_layers >= 1:
        reason = moe_layers_problem(m.moe_layers, m.n_layers)
        if reason:
            add("moe_layers", m.moe_layers, reason, "use all, every:K or after:N")
    if ep >= 1 and m.moe_experts % ep:
        add(
            "parallel.ep",
            ep,
            f"{m.moe_experts} experts cannot be split evenly over {ep} ranks",
            f"use a divisor of {m.moe_experts}: {or_list(divisors(m.moe_experts))}",
        )
    if m.moe_groups:
        check_groups(c, cfg)
    elif m.moe_node_limit and m.moe_top_k >= 1 and not c.reported("parallel.ep"):
        check_node_limit(c, cfg)
    check_expert_tp(c, cfg)


def _check_routing_numbers(c: Checks, m: ModelConfig) -> None:
    """The MoE model's top-k, sizes, loss coefficients, scale, bias rate and capacity."""

    def add(field: str, value: object, reason: str, fix: str) -> None:
        c.add(f"model.{field}", value, reason, fix)

    if m.moe_top_k < 1:
        add("moe_top_k", m.moe_top_k, "every token needs at least one expert", "use k >= 1")
    elif m.moe_top_k > m.moe_experts:
        add(
            "moe_top_k",
            m.moe_top_k,
            f"a token cannot pick more than the {m.moe_experts} experts there are",
            f"use k <= {m.moe_experts}",
        )
    for f in ("moe_shared_experts", "moe_ffn_dim", "moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(m, f) < 0:
            add(f, getattr(m, f), "must be >= 0", "use a value >= 0")
    if m.moe_route_scale <= 0:
        add(
            "moe_route_scale",
            m.moe_route_scale,
            "must be > 0: it multiplies the routed experts' weights",
            "use 1 (the weights as routed), or a published factor such as 2.5 (DeepSeek-V3)",
        )
    if m.balance_bias and m.moe_bias_rate <= 0:
        add(
            "moe_bias_rate",
            m.moe_bias_rate,
            f"moe_balance={m.moe_balance} balances by a bias that moves by this rate per step; "
            "at 0 or below it never balances",
            "use a small positive rate such as 0.001 (DeepSeek-V3's), or moe_balance=aux",
        )
    if m.moe_capacity_factor < 0:
        add(
            "moe_capacity_factor",
            m.moe_capacity_factor,
            "must be >= 0 (0 means dropless routing)",
            "use 0 for dropless, or a factor such as 1.25",
        )


def check_expert_tp(c: Checks, cfg: RecipeConfig) -> None:
    """`parallel.etp` against the tp group it splits and the experts' hidden width."""
    etp, tp, width = cfg.parallel.etp, cfg.parallel.tp, cfg.model.expert_ffn_dim
    if etp <= 1 or tp < 1:
        return  # below 1 the degree rules say why
    if tp % etp:
        c.add(
            "parallel.etp",
            etp,
            f"splits each expert over ranks of the tp group, and tp={tp} is not divisible by it",
            f"use a divisor of tp: {or_list(divisors(tp))}, or raise parallel.tp",
        )
    elif width % etp:
        c.add(
            "parallel.etp",
            etp,
            f"splits each expert's hidden width, and {width} (model.moe_ffn_dim, or ffn_dim "
            "when 0) is not divisible by it",
            f"use a divisor of {width} that divides tp={tp}: "
            f"{or_list([d for d in divisors(width) if tp % d == 0])}",
        )


def check_groups(c: Checks, cfg: RecipeConfig) -> None:
    """`model.moe_groups` (the model's own expert groups) against the experts, the limit of
    groups per token and the top-k."""
    m, field = cfg.model, "model.moe_groups"
    groups, limit = m.moe_groups, m.moe_node_limit
    if groups < 0:
        c.add(field, groups, "must be >= 0", "use 0 (one group per node) or DeepSeek-V3's n_group")
    elif m.moe_experts % groups:
        c.add(
            field,
            groups,
            f"{m.moe_experts} experts do not split into {groups} equal groups",
            f"use a divisor of {m.moe_experts}: {or_list(divisors(m.moe_experts))}",
        )
    elif limit <= 0:
        c.add(
            field,
            groups,
            "expert groups only matter to group-limited routing, and model.moe_node_limit=0 "
            "keeps every group (plain top-k)",
            "set model.moe_node_limit to the groups each token keeps, or model.moe_groups=0",
        )
    elif limit > groups:
        c.add(
            "model.moe_node_limit",
            limit,
            f"a token cannot keep more than the model.moe_groups={groups} groups there are",
            f"use 1 <= moe_node_limit <= {groups}",
        )
    elif m.moe_top_k > limit * (m.moe_experts // groups):
        per_group = m.moe_experts // groups
        c.add(
            "model.moe_node_limit",
            limit,
            f"{limit} group(s) of {per_group} experts each hold fewer than moe_top_k="
            f"{m.moe_top_k} experts",
            f"use moe_node_limit >= {-(-m.moe_top_k // per_group)}, or a smaller moe_top_k",
        )


def check_node_limit(c: Checks, cfg: RecipeConfig) -> None:
    """`model.moe_node_limit` M against the nodes the ep group spans and the top-k."""
    m, field = cfg.model, "model.moe_node_limit"
    limit = m.moe_node_limit
    if limit < 0:
        c.add(field, limit, "must be >= 0", "use 0 (off) or the most nodes a token's experts span")
        return
    try:
        degrees = resolve_degrees(cfg)
    except RecipeError:
        return  # the layout's own rules say why
    gpn = cfg.cluster.gpus_per_node
    nodes = ep_nodes(degrees.ep, degrees.tp * degrees.cp, gpn)
    where = f"parallel.ep={degrees.ep} with tp x cp={degrees.tp * degrees.cp}"
    if nodes is None:
        c.add(
            field,
            limit,
            f"{where} spreads the ep group unevenly over nodes of cluster.gpus_per_node={gpn} "
            "ranks, so the experts have no equal share per node",
            "use an ep whose ranks fill whole nodes (or fit in one), or moe_node_limit=0",
        )
    elif limit > nodes == 1:
        c.add(
            field,
            limit,
            f"{where} fits in one node of {gpn} ranks, so a node limit is moot",
            "use moe_node_limit=0 (off), or an ep group that spans nodes",
        )
    elif limit > nodes:
        c.add(
            field,
            limit,
            f"{where} spans {nodes} nodes of {gpn} ranks",
            f"use 1 <= moe_node_limit <= {nodes}, or 0 (off)",
        )
    elif m.moe_top_k > limit * m.moe_experts // nodes:
        per_node = m.moe_experts // nodes
        c.add(
            field,
            limit,
            f"{limit} node(s) of {per_node} experts each hold fewer than moe_top_k="
            f"{m.moe_top_k} experts",
            f"use moe_node_limit >= {-(-m.moe_top_k // per_node)}, or a smaller moe_top_k",
        )
