"""A mixture-of-experts feed-forward: top-k router, N routed SwiGLU experts, shared experts.

Routing, per token: router logits -> softmax (or sigmoid) scores -> the k best experts,
their scores (optionally renormalized to sum to 1, then times `moe_route_scale`) weight the
experts' outputs; the shared experts' output is added, through a sigmoid gate of its own
with `moe_shared_gate` (Qwen2-MoE). Every
decision that could depend on which tokens share a rank is taken per sequence, so the model
computes the same function under any data- or expert-parallel layout:

- capacity: with `moe_capacity_factor` c > 0 an expert takes at most ceil(c * s * k / N)
  assignments of a sequence of s tokens, first come first served in (position, slot) order;
  a dropped assignment contributes 0 and the token's residual carries it on;
- the load-balancing loss (Switch/GShard form, N * sum_i f_i * P_i, with f_i the share of
  the sequence's k*s assignments routed to expert i before dropping and P_i its mean score)
  is computed per sequence and averaged over the sequences, like the token loss;
- aux-loss-free balancing (`moe_balance=bias|both`, DeepSeek-V3): a per-expert bias is added
  to the scores to pick the k experts (their weights stay the unbiased scores); after each
  optimizer step it moves by `moe_bias_rate` towards the mean load of the step's tokens,
  summed over all data-parallel ranks (`parallel/expert.py`), so it is the same everywhere.
  It is a buffer, not a parameter: no gradient, but saved in checkpoints;
- node-limited routing (`moe_node_limit` M, DeepSeek-V3): the experts form one contiguous
  group per node the ep group spans (`node_groups`, from the recipe's layout, so one process
  computes what the ep ranks do; or `moe_groups` of them, the model's own, as DeepSeek-V3's
  n_group); each token keeps its M best groups (by the sum of a
  group's two best scores, biased when balancing by bias) and takes its k among them. The
  weights are gathered from the scores, so the router's gradient flows through the kept ones.

Experts are stored stacked (w1, w3: [N, f, h], w2: [N, h, f]) so expert parallelism shards
dim 0. The kept assignments are grouped by expert with static shapes (dropped ones last, as
zero rows), so nothing here waits for the host: `dispatch(Grouped)` runs them; locally that
is `GroupedExperts` over cumulative row offsets on the device, and `parallel/expert.py`
swaps in an all-to-all over the EP group.

A rank may hold only a slice of each expert (expert tensor parallelism): then its experts'
outputs are partial sums, and `MoEFeedForward.experts_split` (`WholeExperts` here;
`parallel/expert.py` swaps in the etp group's) sums the combined output over the ranks that
hold the other slices, and the gradients of what fed them (the tokens and the routing weights).

A rank may hold only parts of each sequence (context parallelism): `MoEFeedForward.sequence`
tells the block how many equal parts of every sequence it holds and gathers, per forward,
the assignment counts of the other parts (`WholeSequence` here; `parallel/context.py` swaps
in the ring's), so the capacity queues and the balance loss's fractions are those of the
whole sequence while tokens are dispatched where they are.

Each forward leaves its weighted router losses in `aux_loss` for the trainer to add to the
loss, and accumulates detached routing statistics in `stats` for the metrics and the bias,
once per forward: a forward that activation recompute runs again inside backward counts
nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.core.model_config import ModelConfig
from pretrain.models.layers import FeedForward


def _local(weight: torch.Tensor) -> torch.Tensor:
    # A parameter sharded by expert parallelism is a DTensor: compute on this rank's experts.
    return weight.to_local() if hasattr(weight, "to_local") else weight


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` has a kernel for `dtype` on this kind of device (probed once
    on tiny aligned inputs: some devices implement only bf16)."""
    x = torch.zeros(8, 8, device=device_type, dtype=dtype)
    w = torch.zeros(2, 8, 8, device=device_type, dtype=dtype)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([4, 8], device=device_type, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_supported(x: torch.Tensor, ffn_dim: int) -> bool:
    """Whether the grouped GEMM can run the experts on rows `x` [T, h]: a kernel for the dtype
    and row strides of h and ffn_dim elements that are multiples of 16 bytes."""
    align = 16 // x.element_size()
    if x.shape[-1] % align or ffn_dim % align or not x.is_floating_point():
        return False
    if torch.compiler.is_compiling():
        # What torch.compile traces with: the grouped GEMM's meta kernel takes bf16 only.
        return x.dtype == torch.bfloat16
    return _grouped_mm_runs(x.device.type, x.dtype)


ExpertsKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""Runs the SwiGLU experts on grouped rows: (x [T, h], w1, w3, w2, ends [E] int32) -> [T, h]."""


class GroupedExperts(nn.Module):
    """N SwiGLU experts with stacked weights; runs rows already grouped by expert.

    `kernel`, when set (by `parallel/precision.py`: FP8 grouped GEMMs), runs them instead of
    the grouped GEMM or the loop here."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, gemm: str = "grouped") -> None:
        super().__init__()
        self.gemm = gemm
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.kernel: ExpertsKernel | None = None

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether rows like `x` run through the grouped GEMM (else the reference loop)."""
        return self.gemm == "grouped" and grouped_mm_supported(x, self.w1.shape[1])

    def forward(
        self, x: torch.Tensor, ends: torch.Tensor, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """x [T, h]: each local expert's rows in turn; ends [E] the cumulative row counts
        (int32, on x's device; ends[-1] == T). `sizes`, the same counts on the host when the
        caller knows them, spares the loop path its host sync."""
        # Cast like the rest of the block: FSDP's policy does not cover EP-sharded experts.
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if ends.numel() != w1.shape[0]:
            raise ValueError(f"{ends.numel()} expert groups for {w1.shape[0]} local experts")
        if self.kernel is not None:
            return self.kernel(x, w1, w3, w2, ends.to(torch.int32))
        if self.uses_grouped_mm(x):
            offs = ends.to(torch.int32)
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        if sizes is None:
            sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()  # a host sync
        # A loop of matmuls: every expert (even one without rows) stays in the graph, so
        # data parallelism sees all parameters used in every step.
        outputs = [
            (F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T
            for e, chunk in enumerate(x.split(sizes))
        ]
        return torch.cat(outputs)


@dataclass
class Grouped:
    """One MoE layer's assignments grouped by expert, for a dispatch to run."""

    rows: torch.Tensor
    """[T, h] token rows, T = tokens x k: the kept assignments of expert 0, then of 1, ...,
    then the dropped ones as zero rows."""
    experts: torch.Tensor
    """[T] the expert of each row (N for a dropped one)."""
    counts: torch.Tensor
    """[N] kept rows per expert (on the device)."""
    slot_rows: int | None
    """With a capacity: the most rows one expert can receive from this rank (sequences x
    per-sequence capacity), so buffers of that size never overflow; None when dropless."""


def capacity(cfg: ModelConfig, seq_len: int) -> int | None:
    """Assignments one expert takes per sequence, or None when routing is dropless."""
    if cfg.moe_capacity_factor <= 0:
        return None
    return math.ceil(cfg.moe_capacity_factor * seq_len * cfg.moe_top_k / cfg.moe_experts)


def keep_mask(
    experts: torch.Tensor, n_experts: int, limit: int | None, earlier: torch.Tensor | None = None
) -> torch.Tensor:
    """Which assignments of experts [b, s, k] fit their expert's per-sequence capacity.

    Assignments queue per sequence in (position, slot) order; the first `limit` of each expert
    are kept. None keeps all. `earlier` [b, parts, N]: the s tokens are `parts` equal parts of
    a longer sequence, and each part's queues start behind that many assignments per expert
    (those of the sequence before it); None: they are the whole sequence.
    """
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    b = experts.shape[0]
    parts = 1 if earlier is None else earlier.shape[1]
    one_hot = _one_hot(experts.reshape(b, parts, -1), n_experts)  # [b, parts, s*k/parts, N]
    position = (one_hot.cumsum(2) * one_hot).sum(-1) - 1  # place in its expert's queue
    if earlier is not None:
        position = position + (one_hot * earlier.unsqueeze(2)).sum(-1)
    return (position < limit).view_as(experts)


def _one_hot(ids: torch.Tensor, n: int) -> torch.Tensor:
    # F.one_hot validates the ids' range, which reads them back to the host on some devices.
    return torch.zeros(*ids.shape, n, dtype=torch.long, device=ids.device).scatter_(
        -1, ids.unsqueeze(-1), 1
    )


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many of `ids` (values in [0, n)) name each of n experts; no host sync (unlike
    `bincount` on CUDA, which reads the maximum first)."""
    flat = ids.flatten()
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def load_balancing_loss(
    scores: torch.Tensor, experts: torch.Tensor, n_experts: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """N * sum_i f_i * P_i per sequence, averaged over sequences (1 when perfectly balanced).

    scores [b, s, N] are per-token probabilities over the experts; experts [b, s, k] the
    chosen ones; f_i counts assignments before any dropping. `counts` [b, N]: the assignments
    of the whole sequences when these s tokens are one of its equal parts (None: they are the
    whole sequence); the loss is then this part's term, whose mean over the parts is the
    sequence's loss (f is a constant of the sequence, P_i a mean over equal parts).
    """
    if counts is None:
        counts = expert_counts_per_sequence(experts, n_experts)
    fraction = counts.float() / counts.sum(-1, keepdim=True)
    probability = scores.mean(1)  # [b, N]
    return (n_experts * (fraction * probability).sum(-1)).mean()


def expert_counts_per_sequence(experts: torch.Tensor, n: int, parts: int = 1) -> torch.Tensor:
    """Assignments per expert of experts [b, s, k] in each of `parts` equal parts of every
    sequence: [b, N], or [b, parts, N] when parts > 1."""
    b = experts.shape[0]
    ids = experts.reshape(b, parts, -1)
    counts = torch.zeros(b, parts, n, dtype=torch.long, device=ids.device)
    counts = counts.scatter_add_(-1, ids, torch.ones_like(ids))
    return counts.squeeze(1) if parts == 1 else counts


class WholeSequence:
    """How a MoE block sees its sequences when it holds them whole: one part, nothing to
    gather. Context parallelism replaces it with its ring's view (`parallel/context.py`)."""

    parts = 1
    """Equal parts of every sequence this rank holds (in its token order)."""
    size = 1
    """How many times the rank's tokens the sequence holds."""

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From this rank's assignments per expert [b, parts, N] in each part it holds: the
        sequence's assignments before each of those parts [b, parts, N], and in the whole
        sequence [b, N]."""
        return torch.zeros_like(counts), counts.sum(1)


class WholeExperts:
    """How a MoE block sees its experts when it holds each of them whole: the routed output is
    complete, nothing to sum. Expert tensor parallelism replaces it (`parallel/expert.py`)."""

    def enter(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, an input of the experts' partial outputs, as it is; under expert tensor
        parallelism its gradient is summed over the ranks holding the experts' slices."""
        return tensor

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """The routed output from this rank's share of it (here all of it)."""
        return partial


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of logsumexp(router logits)^2: keeps the router's logits small."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation recompute repeating it."""
    return torch._C._current_graph_task_id() != -1


class RoutingStats:
    """Detached routing counts accumulated over forwards until read (for the metrics), and the
    share of them since the current optimizer step began (for the bias, or to take back)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting anew."""
        self.totals: torch.Tensor | None = None
        self.forwards = 0
        self.step: torch.Tensor | None = None
        self.step_forwards = 0

    @torch.no_grad()
    def add(
        self, routed: torch.Tensor, dropped: torch.Tensor, balance: torch.Tensor, z: torch.Tensor
    ) -> None:
        """Add one forward: assignments per expert [N], dropped ones, and the two losses."""
        # One float64 vector [N + 3], so reading it costs one reduction and no syncs before.
        row = torch.cat([routed.double(), torch.stack([dropped, balance, z]).double()])
        self.totals = row if self.totals is None else self.totals + row
        self.step = row if self.step is None else self.step + row
        self.forwards += 1
        self.step_forwards += 1

    def step_routed(self) -> torch.Tensor | None:
        """Assignments per expert [N] routed since the step began (None: no forward yet)."""
        return None if self.step is None else self.step[:-3]

    def end_step(self) -> None:
        """Keep the step's counts in the totals and begin the next step."""
        self.step, self.step_forwards = None, 0

    @torch.no_grad()
    def drop_step(self) -> None:
        """Take the step's counts back out of the totals (a step that is run again)."""
        if self.step is not None and self.totals is not None:
            self.totals = self.totals - self.step
            self.forwards -= self.step_forwards
        self.end_step()


class MoEFeedForward(nn.Module):
    """Router, routed experts and optional shared experts in place of the dense MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ffn = cfg.expert_ffn_dim
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, ffn, cfg.moe_gemm)
        self.shared: nn.Module | None = None
        self.shared_gate: nn.Linear | None = None
        if cfg.moe_shared_experts:
            self.shared = FeedForward(cfg.dim, cfg.moe_shared_experts * ffn)
            if cfg.moe_shared_gate:
                self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)
        if cfg.balance_bias:
            # Only models that balance by bias carry it, so other checkpoints keep their keys.
            self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        self.dispatch: Callable[[Grouped], torch.Tensor] = self._local_dispatch
        self.aux_loss: torch.Tensor | None = None
        self.stats = RoutingStats()
        self.sequence: WholeSequence = WholeSequence()
        self.experts_split: WholeExperts = WholeExperts()
        # Expert groups of node-limited routing, one per node the ep group spans: set from
        # the recipe (`set_node_groups`), not from process groups, so any layout routes alike.
        # The model's own groups (moe_groups) need no layout.
        self.node_groups = cfg.moe_groups or 1

    def _local_dispatch(self, grouped: Grouped) -> torch.Tensor:
        # The dropped (zero) rows at the end join the last expert's group: they add nothing.
        ends = grouped.counts.cumsum(0)
        ends[-1] = grouped.rows.shape[0]
        return self.experts(grouped.rows, ends)

    def reset_bias(self) -> None:
        """Zero the balancing bias (after `to_empty` left the buffer uninitialized)."""
        if self.cfg.balance_bias:
            self.expert_bias.zero_()

    def step_load(self) -> torch.Tensor:
        """Assignments per expert [N] (float64) routed since the optimizer step began."""
        routed = self.stats.step_routed()
        if routed is None:
            return torch.zeros(
                self.cfg.moe_experts, dtype=torch.float64, device=self.router.weight.device
            )
        return routed

    @torch.no_grad()
    def nudge_bias(self, load: torch.Tensor) -> None:
        """Move each expert's bias by the rate towards the mean of `load` [N] (assignments of
        the step, over all ranks): up when below it, down when above, unchanged at it."""
        step = torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        self.expert_bias.add_(step, alpha=self.cfg.moe_bias_rate)

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k expert ids [b, s, k], their weights [b, s, k], the router scores [b, s, N]
        (softmax over the experts, or sigmoid per expert) and the router logits [b, s, N]."""
        cfg = self.cfg
        logits = self.router(x).float()
        scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
        # The bias decides which experts, never how much they weigh.
        choice = scores + self.expert_bias if cfg.balance_bias else scores
        if cfg.moe_node_limit:
            choice = node_limited(choice, self.node_groups, cfg.moe_node_limit)
        experts = choice.topk(cfg.moe_top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if cfg.moe_normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if cfg.moe_route_scale != 1:
            weights = weights * cfg.moe_route_scale
        return experts, weights, scores, logits

    def _losses(
        self,
        experts: torch.Tensor,
        scores: torch.Tensor,
        logits: torch.Tensor,
        counts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        # The balance loss wants probabilities; sigmoid scores are normalized per token for it.
        probs = scores / scores.sum(-1, keepdim=True)
        balance = load_balancing_loss(probs, experts, cfg.moe_experts, counts)
        zl = z_loss(logits)
        aux = cfg.moe_z_loss_coef * zl
        self.aux_loss = cfg.moe_aux_loss_coef * balance + aux if cfg.balance_loss else aux
        return balance, zl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape
        n, k = cfg.moe_experts, cfg.moe_top_k
        experts, weights, scores, logits = self.route(x)
        # Capacity and balance are decided over whole sequences, of which this rank may
        # hold parts: the other parts' counts come from `sequence` (a collective under cp).
        sequence = self.sequence
        part_counts = expert_counts_per_sequence(experts, n, sequence.parts)
        earlier, counts = sequence.gather_counts(part_counts.view(b, sequence.parts, n))
        limit = capacity(cfg, s * sequence.size)
        keep = keep_mask(experts, n, limit, earlier if sequence.parts > 1 else None)
        balance, zl = self._losses(experts, scores, logits, counts)
        if not recomputing():
            routed = expert_counts(experts, n)
            self.stats.add(routed, (~keep).sum(), balance.detach(), zl.detach())

        tokens = x.reshape(-1, h)
        split = self.experts_split
        flat_keep = keep.flatten()
        # Group the assignments by expert (stable: token order inside each expert), the
        # dropped ones last; shapes depend on b, s and k only.
        keys = torch.where(flat_keep, experts.flatten(), n)
        order = torch.argsort(keys, stable=True)
        keys = keys[order]
        token_ids = torch.arange(b * s, device=x.device).repeat_interleave(k)[order]
        gate = split.enter((weights.flatten() * flat_keep)[order])
        rows = split.enter(tokens)[token_ids]
        if limit is not None:
            rows = rows * (keys < n).unsqueeze(-1).to(rows.dtype)
        counts = torch.zeros(n + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, keys, torch.ones_like(keys))[:n]
        slot_rows = None if limit is None else b * limit
        routed = self.dispatch(Grouped(rows, keys, counts, slot_rows))
        out = torch.zeros_like(tokens).index_add(0, token_ids, routed * gate[:, None].to(routed))
        out = split.leave(out)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            out = out + shared
        return out.view(b, s, h)


def node_limited(choice: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """`choice` [..., N] with the experts outside each token's best `limit` of `groups`
    contiguous expert groups set to -inf (DeepSeek-V3's group-limited routing): a group
    scores the sum of its two best entries (its one entry when it has one expert). A limit
    of every group keeps them all: plain top-k."""
    per_group = choice.view(*choice.shape[:-1], groups, -1)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    kept = group_scores.topk(min(limit, groups), dim=-1).indices
    mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, kept, False)
    return per_group.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(-2)


def set_node_groups(model: nn.Module, groups: int) -> None:
    """Route every MoE layer of `model` over `groups` expert groups (one per node)."""
    for moe in moe_modules(model):
        if moe.cfg.moe_experts % groups:
            raise ValueError(f"{moe.cfg.moe_experts} experts do not split into {groups} groups")
        moe.node_groups = groups


def moe_modules(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE feed-forwards, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def router_losses(model: nn.Module) -> torch.Tensor | None:
    """The sum of the weighted router losses of the last forward, or None for a dense model."""
    losses = [m.aux_loss for m in moe_modules(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
