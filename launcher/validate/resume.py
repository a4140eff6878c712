"""Which config changes a run dir accepts: a resumed run may change how it is laid out and
how long it runs, never what it trains.

Layout and operations (parallel degrees, cluster, recompute, checkpoint and fault settings,
logging, evaluation, the preparation workers, train.micro_batch) and the length
(train.steps) may differ from the run dir's config.yaml; the model, data, seed, optimizer,
schedule and batch shape may not, because the checkpoint and the data position would then
mean something else. init.* may change: a resumed run loads its checkpoint instead. Under
`model.moe_node_limit` the layout decides the router's expert groups (one per node the ep
group spans), so a layout that changes them is refused too.
"""

from __future__ import annotations

from typing import Any

from pretrain.core.layout import ep_nodes

CHANGEABLE = (
    "action",
    "plan.",
    "calibrate.",
    "run.",
    "parallel.",
    "cluster.",
    "recompute.",
    "checkpoint.",
    "faults.",
    "logging.",
    "hardware.",
    "eval.",
    "init.",
    "data.workers",
    "train.steps",
    "train.micro_batch",
    "optim.distributed_muon",
)
"""Dotted field names (or prefixes ending in '.') a resumed run may change."""


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def _flat(yaml: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return _flatten(OmegaConf.to_container(OmegaConf.create(yaml)))


def changed_fields(old_yaml: str, new_yaml: str) -> list[str]:
    """Dotted names of the fields whose values differ between two resolved configs."""
    old, new = _flat(old_yaml), _flat(new_yaml)
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def _expert_groups(flat: dict[str, Any]) -> int | None:
    """The router's expert groups a node-limited config routes over (None: no limit)."""
    if not flat.get("model.moe_node_limit"):
        return None
    if flat.get("model.moe_groups"):
        return int(flat["model.moe_groups"])  # the model's own: no layout decides them
    stride = flat.get("parallel.tp", 1) * flat.get("parallel.cp", 1)
    return ep_nodes(flat.get("parallel.ep", 1), stride, flat.get("cluster.gpus_per_node", 1))


def frozen_changes(old_yaml: str, new_yaml: str) -> list[str]:
    """The changed fields a resumed run may not change (empty: the new config may replace
    the old one)."""
    frozen = [
        name
        for name in changed_fields(old_yaml, new_yaml)
        if not any(name == c or (c.endswith(".") and name.startswith(c)) for c in CHANGEABLE)
    ]
    old, new = _expert_groups(_flat(old_yaml)), _expert_groups(_flat(new_yaml))
    if old is not None and new is not None and old != new:
        frozen.append(
            f"the nodes the ep group spans under model.moe_node_limit ({old} -> {new}: "
            "the router's expert groups)"
        )
    return frozen
