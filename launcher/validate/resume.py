"""Which config changes a run dir accepts: a resumed run may change how it is laid out and
how long it runs, never what it trains.

Layout and operations (parallel degrees, cluster, recompute, checkpoint and fault settings,
logging, evaluation, the preparation workers, train.micro_batch) and the length
(train.steps) may differ from the run dir's config.yaml; the model, data, seed, optimizer,
schedule and batch shape may not, because the checkpoint and the data position would then
mean something else. init.* may change: a resumed run loads its checkpoint instead.
"""

from __future__ import annotations

from typing import Any

CHANGEABLE = (
    "action",
    "plan.",
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
)
"""Dotted field names (or prefixes ending in '.') a resumed run may change."""


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def changed_fields(old_yaml: str, new_yaml: str) -> list[str]:
    """Dotted names of the fields whose values differ between two resolved configs."""
    from omegaconf import OmegaConf

    old = _flatten(OmegaConf.to_container(OmegaConf.create(old_yaml)))
    new = _flatten(OmegaConf.to_container(OmegaConf.create(new_yaml)))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def frozen_changes(old_yaml: str, new_yaml: str) -> list[str]:
    """The changed fields a resumed run may not change (empty: the new config may replace
    the old one)."""
    return [
        name
        for name in changed_fields(old_yaml, new_yaml)
        if not any(name == c or (c.endswith(".") and name.startswith(c)) for c in CHANGEABLE)
    ]
