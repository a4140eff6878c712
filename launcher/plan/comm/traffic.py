"""The bytes one rank hands to collectives in one optimizer step, by kind: the cost model's
communication terms as bytes, to set beside what a dry run counts (`action=dryrun`).

A collective's bytes here are those of the tensors the rank hands to it, as the dry run's
counter reads them from the dispatcher (trainer/dryrun/collectives.py): an all-gather's
shard, a reduce-scatter's or an all-reduce's whole input, an all-to-all's whole buffer (its
own share included), a send's tensor and a receive's buffer. What crosses the link follows
from the kind and the group (`wire_bytes`); the cost model's seconds are those bytes over
the group's bandwidth.

By source, for the rank's pipeline stage (its layers, the embedding on the first, the head
on the last):

- tp: `tp_comm.rank_collectives` per micro-batch (the blocks', the embedding's, the head's
  and the loss's, the multi-token prediction modules'), and expert tensor parallelism's
  all-reduces (`ep_comm.etp_all_reduces`);
- ep: the all-to-alls of its MoE layers (`ep_comm`);
- cp: the K/V ring's sends and receives (`cp_comm`);
- pp: one activation forward and one gradient backward per micro-batch and stage boundary
  that crosses to another rank, and the tied embedding's gradient between the first and
  last stage;
- dp: the trainer's bookkeeping (launcher/plan/memory.py states it): ZeRO-2/3 (FSDP2) gather
  the parameters in the compute dtype (ZeRO-2 once per step; ZeRO-3 each block twice per
  micro-batch and the root once per micro-batch) and reduce-scatter the FP32 (or
  `reduce_dtype`) gradients once per step, all-reducing the shard over dp_replicate;
  ZeRO-0/1 (DDP) all-reduce them once per step and broadcast the buffers (the rotary
  tables) each forward; ZeRO-1 then broadcasts every updated FP32 parameter from its owner.
  PipeDream-2BW, which never accumulates without syncing, reduces (and ZeRO-2 gathers) once
  per micro-batch. Routed experts reduce over the ranks holding the same experts.

Not counted: the step's scalars (the gradient norm's partial sums, the bad-step agreement,
the MoE slot bound's all-reduce), a few KB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.core.layout import Degrees, uses_fsdp
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import head_rank, placement, rank_stages, stage_ranks
from pretrain.launcher.plan.comm.cp import cp_communication
from pretrain.launcher.plan.comm.ep import (
    all_to_alls,
    ep_communication,
    etp_all_reduces,
    etp_communication,
)
from pretrain.launcher.plan.comm.tp import REDUCE_BYTES, rank_collectives, sp_weight_reduction
from pretrain.launcher.plan.memory import (
    local_tokens,
    moe_tp_replicated,
    mtp_tp_replicated,
    rank_layers,
    residual_bytes,
    stage_experts,
    stage_params,
    tp_replicated,
    weight_versions,
)
from pretrain.models.flops import count_params

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", "recv")
"""Collective kinds, in the dry run's names."""


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank hands to collectives in one step: source (tp, ep, cp, pp, dp) -> kind
    -> bytes."""

    by_source: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def by_kind(self) -> dict[str, float]:
        """Bytes per kind, every source summed."""
        kinds: dict[str, float] = {}
        for figures in self.by_source.values():
            for kind, value in figures.items():
                kinds[kind] = kinds.get(kind, 0.0) + value
        return {kind: kinds[kind] for kind in KINDS if kinds.get(kind)}


def wire_bytes(kind: str, group: int, handed: float) -> float:
    """Bytes a rank puts on the link for a collective it hands `handed` bytes, in a ring of
    `group` ranks: (n-1) shards for an all-gather, (n-1)/n of the input for a
    reduce-scatter or all-to-all, twice that for an all-reduce; a send its tensor."""
    if kind == "all_gather":
        return handed * (group - 1)
    if kind == "all_reduce":
        return 2 * handed * (group - 1) / group
    if kind in ("reduce_scatter", "all_to_all", "broadcast"):
        return handed * (group - 1) / group
    return handed if kind == "send" else 0.0


def step_traffic(cfg: RecipeConfig, degrees: Degrees, microbatches: int, pp_rank: int) -> Traffic:
    """What a rank of pipeline rank `pp_rank` hands to collectives in one step of
    `microbatches` micro-batches (the schedule's under pp), by source and kind."""
    # Every rank computes its dp share of the batch and its cp share of each sequence.
    tokens = cfg.train.global_batch // degrees.dp * local_tokens(cfg)
    layers = rank_layers(cfg, pp_rank)
    sources = {
        "tp": _tp(cfg, degrees, pp_rank, layers, tokens, microbatches),
        "ep": _ep(cfg, degrees, layers, tokens),
        "cp": _cp(cfg, degrees, layers),
        "pp": _pp(cfg, degrees, pp_rank, tokens),
        "dp": _dp(cfg, degrees, microbatches, pp_rank),
    }
    return Traffic({name: figures for name, figures in sources.items() if figures})


def _add(into: dict[str, float], kind: str, value: float) -> None:
    if value:
        into[kind] = into.get(kind, 0.0) + value


def _tp(
    cfg: RecipeConfig,
    degrees: Degrees,
    pp_rank: int,
    layers: tuple[int, ...],
    tokens: int,
    microbatches: int,
) -> dict[str, float]:
    p = cfg.parallel
    last = pp_rank == head_rank(degrees.pp, p.vpp, _style(cfg))
    calls = rank_collectives(cfg, degrees, layers, pp_rank == 0, last, tokens / microbatches)
    out: dict[str, float] = {}
    for kind, handed in calls:
        _add(out, kind, handed * microbatches)
    reductions = microbatches if weight_versions(cfg) > 1 else 1
    _add(out, "all_reduce", reductions * sp_weight_reduction(cfg, degrees, layers, last))
    # Expert tensor parallelism's all-reduces, over the etp ranks of the tp group.
    comm = etp_communication(cfg, degrees)
    if comm is not None:
        outputs, gates = etp_all_reduces(cfg, layers)
        per_micro = outputs * comm.output_bytes + gates * comm.gate_bytes
        micro_tokens = local_tokens(cfg) * cfg.train.micro_batch
        _add(out, "all_reduce", per_micro * tokens / micro_tokens)
    return out


def _ep(
    cfg: RecipeConfig, degrees: Degrees, layers: tuple[int, ...], tokens: int
) -> dict[str, float]:
    comm = ep_communication(cfg, degrees)
    if comm is None:
        return {}
    # The message leaves out the rank's own share; the buffer handed in holds it.
    per_micro = comm.message_bytes * degrees.ep / (degrees.ep - 1)
    micro_tokens = local_tokens(cfg) * cfg.train.micro_batch
    return {"all_to_all": all_to_alls(cfg, layers) * per_micro * tokens / micro_tokens}


def _cp(cfg: RecipeConfig, degrees: Degrees, layers: tuple[int, ...]) -> dict[str, float]:
    comm = cp_communication(cfg, degrees)
    if comm is None:
        return {}
    sent = comm.sent_bytes * len(layers)
    return {"send": sent, "recv": sent}


def _style(cfg: RecipeConfig) -> str:
    return placement(cfg.parallel.pp_schedule) if cfg.parallel.pp > 1 else "loop"


def _pp(cfg: RecipeConfig, degrees: Degrees, pp_rank: int, tokens: int) -> dict[str, float]:
    pp = degrees.pp
    if pp == 1:
        return {}
    p, style = cfg.parallel, _style(cfg)
    vpp = SCHEDULES[p.pp_schedule].chunks(p.vpp)
    owners = stage_ranks(pp, vpp, style)
    fsdp = uses_fsdp(p, degrees)
    sp = p.sp and degrees.tp > 1
    hidden = tokens * cfg.model.dim * residual_bytes(cfg, fsdp) / (degrees.tp if sp else 1)
    out: dict[str, float] = {}
    for stage in rank_stages(pp_rank, pp, vpp, style):
        # Each boundary to another rank: the activation one way, its gradient the other.
        for neighbour in (stage - 1, stage + 1):
            if 0 <= neighbour < len(owners) and owners[neighbour] != pp_rank:
                _add(out, "send", hidden)
                _add(out, "recv", hidden)
    first, last = pp_rank == 0, pp_rank == head_rank(pp, p.vpp, style)
    if cfg.model.tie_embeddings and style != "v" and (first or last):
        grads = 4 * count_params(cfg.model).embedding / degrees.tp
        _add(out, "all_reduce", grads / (degrees.dp_shard * degrees.cp if fsdp else 1))
    return out


def _dp(cfg: RecipeConfig, degrees: Degrees, microbatches: int, pp_rank: int) -> dict[str, float]:
    """The data-parallel collectives of the rank's dense parameters and routed experts."""
    m, p, t = cfg.model, cfg.parallel, degrees.tp
    counts = count_params(m)
    blocks_params, root, blocks = stage_params(cfg, pp_rank, counts)
    experts = stage_experts(cfg, pp_rank, counts)
    last = pp_rank == head_rank(degrees.pp, p.vpp, _style(cfg))
    # Norms, MLA's latent down-projections, K and V when their heads are fewer than tp, and
    # a MoE layer's router and shared experts are whole on every TP rank; the rest is split
    # (as launcher/plan/memory.py counts them).
    moe_whole = moe_tp_replicated(m) * m.n_moe_layers * blocks // m.n_layers if blocks else 0
    whole = tp_replicated(m, t) * blocks + moe_whole
    if last:  # the multi-token prediction modules, counted with the blocks
        whole += mtp_tp_replicated(m, t)
    block_dense = (blocks_params - experts - whole) / t + whole
    final_norm = m.dim if last else 0
    dense = block_dense + (root - final_norm) / t + final_norm
    c, g = COMPUTE_BYTES[cfg.precision.dtype], REDUCE_BYTES[cfg.precision.reduce_dtype]
    n = degrees.grad_replicas
    # PipeDream-2BW accumulates no micro-batch without syncing: each one reduces its
    # gradient, and (ZeRO-2) gathers its version's weights, which it reshards after.
    reductions = microbatches if weight_versions(cfg) > 1 else 1
    out: dict[str, float] = {}
    if n > 1 and p.zero >= 2:
        shard = degrees.dp_shard * degrees.cp
        # ZeRO-3 gathers each block in every micro-batch's forward and backward, the root
        # (embedding, final norm, head) in every forward.
        gathers = reductions * dense if p.zero == 2 else 2 * microbatches * block_dense
        if p.zero == 3:
            gathers += microbatches * (dense - block_dense)
        _add(out, "all_gather", c * gathers / shard)
        _add(out, "reduce_scatter", reductions * g * dense)
        if degrees.dp_replicate > 1:
            _add(out, "all_reduce", reductions * g * dense / shard)
    elif n > 1:
        _add(out, "all_reduce", reductions * g * dense)
        rope = 2 * m.max_seq_len * (m.rope_dim // 2) * 4
        _add(out, "broadcast", rope * microbatches)
        if p.zero == 1 and degrees.dp_shard > 1:
            _add(out, "broadcast", 4 * dense)
    if experts:
        local = experts / (degrees.ep * degrees.etp)
        edp = n // degrees.ep
        if edp > 1 and p.zero >= 2:
            gathers = reductions if p.zero == 2 else 2 * microbatches
            _add(out, "all_gather", c * gathers * local / edp)
            _add(out, "reduce_scatter", reductions * 4 * local)
        elif edp > 1:
            _add(out, "all_reduce", 4 * local)
    return out
