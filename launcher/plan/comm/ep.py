"""Expert parallelism's all-to-all traffic per MoE layer and micro-batch, for the cost model.

Per MoE layer and micro-batch (parallel/expert.py): the dispatch sends every assignment's
row (tokens x top_k of them, dim wide, in the compute dtype) to its expert's rank and the
combine brings the outputs back, both one even `all_to_all_single`; backward runs the same
two with the gradients (the functional autograd form), and a recomputed block (full or
selective: selective recompute keeps no all-to-all's output) runs its forward's two again.
Each all-to-all keeps (1/ep) of its rows on the rank and sends the rest; the rows are the
dispatch's slots, `memory.dispatch_padding` times the assignments (a capacity factor, or
the dropless slots' start). A MoE layer is not split over tp: every
TP rank routes its cp share of the whole sequence. The ep ranks are tp x cp apart (ep
splits the flattened data-parallel index, inner), so the exchange stays inside a node when
tp x cp x ep ranks fit one.

Node-limited routing (`model.moe_node_limit` M; over `model.moe_groups` of the model's own,
as many nodes as those M groups span) bounds the nodes one token's rows reach:
`inter_node_bytes` counts one row per token and remote node it reaches (the most a dispatch
that sends a token once per node and fans it out inside the node carries, DeepSeek-V3's),
min(k, M) nodes per token of which (G - 1) / G are other nodes at balanced load, for an ep
group over G nodes. The all-to-all here sends every assignment's row, so its time reads
`message_bytes`.

Expert tensor parallelism (`parallel.etp`) adds all-reduces over the etp ranks (consecutive
ranks of a tp group): per MoE layer and micro-batch, the forward sums the combined routed
output (tokens x dim in the compute dtype), the backward the gradient of the tokens that fed
the expert slices (the same size) and of the routing weights (tokens x top_k, FP32), and a
fully recomputed block sums its forward's output again (`etp_all_reduces`). The all-to-all's
bytes do not change: each etp rank exchanges whole rows with the ep ranks of its tp index.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.layout import Degrees, ep_nodes
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.recompute import is_recomputed
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.memory import dispatch_padding


@dataclass(frozen=True)
class EPComm:
    """One MoE layer's all-to-alls per micro-batch, on one rank."""

    message_bytes: float
    """Bytes one all-to-all sends from this rank (the share kept local left out)."""
    stride: int
    """Global ranks between two members of the ep group (tp x cp)."""
    nodes_per_token: int
    """The most nodes one token's rows reach: min(k, moe_node_limit or the nodes spanned)."""
    inter_node_bytes: float
    """Bytes per all-to-all that leave this rank's node, one row per token and remote node."""


def ep_communication(cfg: RecipeConfig, degrees: Degrees) -> EPComm | None:
    """The all-to-all of one MoE layer and micro-batch; None without expert parallelism."""
    m, ep = cfg.model, degrees.ep
    if ep == 1 or not m.moe_experts:
        return None
    tokens = cfg.train.seq_len // degrees.cp * cfg.train.micro_batch
    rows = tokens * m.moe_top_k * dispatch_padding(cfg)
    row_bytes = m.dim * COMPUTE_BYTES[cfg.precision.dtype]
    sent = rows * row_bytes * (ep - 1) / ep
    nodes = ep_nodes(ep, degrees.tp * degrees.cp, cfg.cluster.gpus_per_node) or 1
    reach = min(m.moe_top_k, _groups_reach(m.moe_node_limit, m.moe_groups, nodes), nodes)
    remote = tokens * reach * row_bytes * (nodes - 1) / nodes
    return EPComm(sent, degrees.tp * degrees.cp, reach, remote)


def _groups_reach(limit: int, groups: int, nodes: int) -> int:
    """The most nodes the kept expert groups of one token span: `limit` node groups, or
    `limit` of the model's own `groups` (each inside a node when groups divide over the
    nodes, each over nodes / groups nodes when the nodes divide over them)."""
    if not limit:
        return nodes
    if not groups or groups % nodes == 0:
        return limit
    return limit * nodes // groups if nodes % groups == 0 else nodes


def all_to_alls(cfg: RecipeConfig, layers: tuple[int, ...]) -> int:
    """All-to-alls per micro-batch of the MoE layers among `layers`: dispatch and combine in
    forward and backward, and the forward's again in a recomputed block."""
    count = 0
    for layer in layers:
        if cfg.model.is_moe_layer(layer):
            count += 4 + (2 if is_recomputed(cfg.recompute, layer) else 0)
    return count


@dataclass(frozen=True)
class ETPComm:
    """One MoE layer's expert-tensor-parallel all-reduces per micro-batch, on one rank."""

    output_bytes: float
    """Bytes of the routed output summed over etp (tokens x dim, compute dtype); the
    tokens' gradient in backward is the same size."""
    gate_bytes: float
    """Bytes of the routing weights' gradient summed over etp in backward (tokens x top_k,
    FP32)."""


def etp_communication(cfg: RecipeConfig, degrees: Degrees) -> ETPComm | None:
    """The etp all-reduces of one MoE layer and micro-batch; None without etp."""
    m = cfg.model
    if degrees.etp == 1 or not m.moe_experts:
        return None
    # Every tp rank routes its cp share of the whole sequence (gathered under SP).
    tokens = cfg.train.seq_len // degrees.cp * cfg.train.micro_batch
    return ETPComm(tokens * m.dim * COMPUTE_BYTES[cfg.precision.dtype], tokens * m.moe_top_k * 4)


def etp_all_reduces(cfg: RecipeConfig, layers: tuple[int, ...]) -> tuple[int, int]:
    """(output-sized, gate-sized) etp all-reduces per micro-batch of the MoE layers among
    `layers`: the output in forward, the tokens' and the weights' gradients in backward,
    and the output again in a fully recomputed block."""
    m, full = cfg.model, cfg.recompute.policy == "full"
    output = gate = 0
    for layer in layers:
        if m.is_moe_layer(layer):
            output += 2 + (1 if full and is_recomputed(cfg.recompute, layer) else 0)
            gate += 1
    return output, gate
