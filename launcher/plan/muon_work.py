"""Muon's Newton-Schulz work per optimizer step and the traffic of moving its matrices, with
and without distributed Muon (`optim.distributed_muon`, trainer/optim/distributed_muon.py).

The matrices are a pipeline rank's blocks' weight matrices (the ones Muon updates: attention
and MLP projections, the router, each routed and shared expert's three; on the last stage
the multi-token prediction modules' projections and blocks), whole even under tp,
which shards them but orthogonalizes them whole; a rank holds N / ep routed experts of each
MoE layer. FLOPs follow `core.optim_states` and the split is its `assign_owners`, the one the
trainer runs, so the busiest rank's share is exact. Bytes are FP32 elements each rank
receives in the step (a ring all-gather sends as many):

- without the split, an FSDP2 rank gathers every update whole: (1 - 1/(s tp)) of the
  matrices for a shard group of s and tp; a DDP rank holds them whole and moves nothing;
- split over n ranks holding slices (FSDP2 without tp): each owner receives the (n - 1) / n
  of its matrices it lacks and each rank its slices of the others' back, 2 (n - 1) / n^2;
- split over n ranks holding whole matrices (DDP; FSDP2 x TP after the same gather as
  without the split): the all-gather of the results, (n - 1) / n.

ZeRO-1 gives each rank its own parameters already; the split is not applied on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.layout import Degrees, uses_fsdp
from pretrain.core.model_config import ModelConfig
from pretrain.core.optim_states import busiest_load, newton_schulz_flops
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import head_rank, placement
from pretrain.launcher.plan.memory import rank_layers
from pretrain.models.flops import mlp_matrices

FP32_BYTES = 4


@dataclass(frozen=True)
class MuonWork:
    """Newton-Schulz FLOPs and the bytes received to orthogonalize, per optimizer step on the
    busiest pipeline rank, without and with the split."""

    ranks: int
    """Ranks the (dense) matrices' work is split over; 1 when it is not split."""
    flops_unsplit: int
    """FLOPs when every rank orthogonalizes every matrix it holds."""
    flops: int
    """FLOPs of the busiest rank under the recipe's setting."""
    bytes_unsplit: float
    bytes: float

    @property
    def saved_flops(self) -> int:
        """FLOPs the split takes off the busiest rank."""
        return self.flops_unsplit - self.flops

    @property
    def extra_bytes(self) -> float:
        """Bytes the split adds per rank (negative: it saves traffic)."""
        return self.bytes - self.bytes_unsplit


def block_matrices(cfg: ModelConfig, layer: int | None) -> tuple[list[tuple[int, int]], int]:
    """Block `layer`'s Muon matrices (rows, cols) besides its routed experts, and its routed
    experts (0 for a dense layer; each has the three matrices of `expert_matrices`). Layer
    None: an MTP module's dense block with its projection of [embedding; hidden]."""
    h = cfg.dim
    if cfg.is_mla:
        heads, qk = cfg.n_heads, cfg.qk_head_dim
        q_rank = cfg.mla_q_rank
        attention = [(q_rank, h), (heads * qk, q_rank)] if q_rank else [(heads * qk, h)]
        attention += [
            (cfg.kv_rank + cfg.rope_dim, h),
            (heads * (cfg.nope_dim + cfg.v_head_dim), cfg.kv_rank),
            (h, heads * cfg.v_head_dim),
        ]
    else:
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        attention = [(q, h), (kv, h), (kv, h), (h, q)]
    if layer is None or not cfg.is_moe_layer(layer):
        ffn = cfg.ffn_dim
        up = [(ffn, h)] * (mlp_matrices(cfg) - 1)
        projection = [(h, 2 * h)] if layer is None else []
        return [*projection, *attention, *up, (h, ffn)], 0
    e = cfg.expert_ffn_dim
    shared = [(e, h), (e, h), (h, e)] * cfg.moe_shared_experts
    return [*attention, (cfg.moe_experts, h), *shared], cfg.moe_experts


def expert_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The three matrices (rows, cols) of one routed expert's SwiGLU."""
    e, h = cfg.expert_ffn_dim, cfg.dim
    return [(e, h), (e, h), (h, e)]


def muon_work(cfg: RecipeConfig, degrees: Degrees) -> MuonWork | None:
    """Muon's work on the busiest pipeline rank; None for another optimizer."""
    if cfg.optim.name != "muon":
        return None
    zero1 = cfg.parallel.zero == 1 and degrees.dp_shard > 1
    fsdp = uses_fsdp(cfg.parallel, degrees)
    split = cfg.optim.distributed_muon and degrees.grad_replicas > 1 and not zero1
    edp = degrees.dp // degrees.ep * degrees.cp
    shard = degrees.dp_shard * degrees.cp
    dense_ranks = (degrees.grad_replicas * degrees.tp if fsdp and degrees.tp > 1 else
                   shard if fsdp else degrees.grad_replicas)  # fmt: skip
    dense_ranks = dense_ranks if split else 1
    expert_ranks = edp if split else 1
    if zero1:
        dense_ranks = expert_ranks = degrees.dp_shard
    p = cfg.parallel
    last = head_rank(p.pp, p.vpp, placement(p.pp_schedule) if p.pp > 1 else "loop")
    best: MuonWork | None = None
    for rank in range(degrees.pp):
        dense: list[tuple[int, int]] = []
        experts: list[tuple[int, int]] = []
        layers: list[int | None] = list(rank_layers(cfg, rank))
        if rank == last:
            layers += [None] * cfg.model.mtp_layers  # the MTP modules, on the last stage
        for layer in layers:
            matrices, count = block_matrices(cfg.model, layer)
            dense += matrices
            experts += expert_matrices(cfg.model) * (count // degrees.ep)
        work = _work(dense, experts, dense_ranks, expert_ranks, degrees, fsdp, split)
        if best is None or work.flops > best.flops:
            best = work
    return best


def _work(
    dense: list[tuple[int, int]],
    experts: list[tuple[int, int]],
    dense_ranks: int,
    expert_ranks: int,
    degrees: Degrees,
    fsdp: bool,
    split: bool,
) -> MuonWork:
    def costs(shapes: list[tuple[int, int]]) -> list[float]:
        return [float(newton_schulz_flops(r, c)) for r, c in shapes]

    flops_unsplit = sum(newton_schulz_flops(r, c) for r, c in dense + experts)
    flops = busiest_load(costs(dense), dense_ranks) + busiest_load(costs(experts), expert_ranks)
    dense_bytes = FP32_BYTES * sum(r * c for r, c in dense)
    expert_bytes = FP32_BYTES * sum(r * c for r, c in experts)
    edp = degrees.dp // degrees.ep * degrees.cp
    if fsdp:
        # Gathered whole over the shard group (and tp); experts over their edp holders.
        dense_gather = (1 - 1 / (degrees.dp_shard * degrees.cp * degrees.tp)) * dense_bytes
        expert_gather = (1 - 1 / edp) * expert_bytes
    else:
        dense_gather, expert_gather = (1 - 1 / degrees.tp) * dense_bytes, 0.0
    unsplit = dense_gather + expert_gather
    received = unsplit
    if split:
        sliced = fsdp and degrees.tp == 1
        received = _split_bytes(dense_bytes, dense_ranks, sliced, dense_gather)
        received += _split_bytes(expert_bytes, expert_ranks, fsdp, expert_gather)
    return MuonWork(dense_ranks, flops_unsplit, round(flops), unsplit, received)


def _split_bytes(total: float, n: int, sliced: bool, gathered: float) -> float:
    """Bytes received to split `total` bytes of matrices over `n` ranks: slices to their owner
    and back when the ranks hold slices, else the all-gather of the results after the
    `gathered` bytes that make sharded matrices whole (as without the split)."""
    if n == 1:
        return gathered
    if sliced:
        return 2 * (n - 1) / n**2 * total
    return gathered + (n - 1) / n * total
