"""Tensor and sequence parallelism: a plan over DTensor for the plain Llama model.

Within each block, Q/K/V and the SwiGLU gate/up projections are split column-wise (each TP
rank holds whole heads, and whole KV heads); the attention output and the down projection
are split row-wise, so each half-block ends in one reduction.

Grouped-query attention with fewer key/value heads than tp (tp a multiple of them, as
Megatron allows: Llama 3 70B's 8 KV heads at TP 16) replicates the KV heads: the K and V
weights stay whole on every rank (plain tensors, like MLA's latent projections), and each
rank computes only the one KV head its query heads share (rank r takes head r // (tp /
kv_heads)). Its input's gradient joins the query projection's partial sum, reduced once
with it; the weights' gradient, nonzero in the rows of this rank's head, is summed over tp,
so every rank holds the full gradient of the whole weights. Under FP8 these two projections
run in the compute dtype.
The token embedding is split row-wise over the vocabulary and the LM head column-wise, and
the loss is computed vocab-parallel (`loss_parallel`), so full logits never sit on one rank.
Multi-token prediction modules (models/mtp.py) split their blocks as the model's; their
norms and their projection of [embedding; hidden] stay replicated (sequence-parallel under
SP, plain tensors without it, as the blocks' norms).
The embedding looks its tokens up in its own rows (`_VocabParallelEmbedding`, Megatron's
VocabParallelEmbedding), so its backward computes only those rows' gradient: DTensor's
row-wise embedding has no such backward and computes the whole vocabulary's on every TP rank
(vocab x dim, and its FP32 copy held across micro-batches: 3 GiB per rank for Llama 3 8B at
tp=8), keeping its slice.

With sequence parallelism the norms and residuals run on sequence-sharded activations: the
reduction after attention and after the MLP becomes a reduce-scatter over the sequence, and
each column-wise projection all-gathers its input, for the same communication volume.

Multi-head latent attention (models/mla.py) splits its heads the same way: the query
projection (wq, or wq_b after a query latent) and the latent's up-projection wkv_b
column-wise, wo row-wise. The down-projections to the latents (wkv_a, wq_a) and their norms
are small and stay replicated plain tensors: the attention takes its input as a local
(replicated) tensor, and each column-wise projection's input gradient is summed over tp as
it leaves, so the replicated weights get the full gradient on every TP rank. The rotary key,
shared by all heads, reaches a rank's heads through `shared_key`, whose gradient (from this
rank's heads only) is summed over tp the same way; so do the per-head query/key norm weights
of `model.qk_norm`. The biases of `model.attn_bias` are split with their projections.

Vocabulary padding: a vocabulary that tp does not divide is padded to the next multiple of
tp. The padded rows start at zero and their logits are masked to -inf before the softmax,
so they never receive a gradient and the loss is exactly that of the unpadded model. The
padded size therefore depends on tp while the training run does not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from pretrain.core.schema import ParallelConfig
from pretrain.models.mla import MultiHeadLatentAttention
from pretrain.models.moe import MoEFeedForward
from pretrain.parallel.mesh import JobMesh

VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")
"""Parameters whose first dim is the (possibly padded) vocabulary."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp, so every rank holds an equal slice."""
    return -(-vocab_size // tp) * tp


def apply_tensor_parallel(model: nn.Module, mesh: JobMesh, parallel: ParallelConfig) -> None:
    """Shard the meta-device model over the mesh's `tp` dim, in place (no-op at tp=1)."""
    if mesh.degrees.tp == 1:
        return
    tp_mesh = mesh.world["tp"]
    _pad_vocab(model, mesh.degrees.tp)
    sp = parallel.sp
    # Between blocks the residual stream is sequence-sharded with SP, replicated without.
    residual = Shard(1) if sp else Replicate()
    tp_rank, tp = tp_mesh.get_local_rank(), mesh.degrees.tp
    replicated_kv = model.cfg.attention != "mla" and model.cfg.kv_heads < tp
    mtp = list(model.mtp.values()) if model.mtp is not None else []
    for block in [*model.layers.values(), *(module.block for module in mtp)]:
        plan = _attention_plan(block.attention, residual, replicated_kv)
        if replicated_kv:
            head = tp_rank // (tp // model.cfg.kv_heads)
            for linear in (block.attention.wk, block.attention.wv):
                linear.forward = _OneKVHead(linear, head, model.cfg.head_dim, tp_mesh)
        if isinstance(block.attention, MultiHeadLatentAttention):
            block.attention.shared_key.register_forward_hook(_SumGradient(tp_mesh))
        elif block.attention.q_norm is not None:
            # The per-head norm weights see only this rank's heads: sum their gradient.
            block.attention.per_head = _SumGradient(tp_mesh).of
        if isinstance(block.feed_forward, MoEFeedForward):
            # Not split over tp: every TP rank routes the whole (gathered) sequence, so
            # capacity counts per sequence as without TP (parallel/expert.py).
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(residual,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(residual,),
            )
        else:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),)
            )
            plan["feed_forward.w1"] = ColwiseParallel()
            if hasattr(block.feed_forward, "w3"):  # SwiGLU's up projection
                plan["feed_forward.w3"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=residual)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if sp:
        for module in mtp:
            parallelize_module(module, tp_mesh, _mtp_plan())
    root_plan = {
        "tok_embeddings": _VocabParallelEmbedding(residual),
        # Logits stay a vocab-sharded DTensor for the vocab-parallel loss.
        "output": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    # A pipeline stage holds None in place of the modules of other stages.
    root_plan = {key: style for key, style in root_plan.items() if getattr(model, key) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    if model.cfg.tie_embeddings and None not in (model.tok_embeddings, model.output):
        # Each style distributed its own copy; the embedding's and head's shards coincide
        # (both Shard(0) over the vocabulary), so the head can share the embedding's.
        model.output.weight = model.tok_embeddings.weight
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_resolved)
    padded = padded_vocab(model.cfg.vocab_size, mesh.degrees.tp) != model.cfg.vocab_size
    if padded and model.output is not None:
        model.output.register_forward_hook(_VocabMask(model.cfg.vocab_size, tp_mesh))


def _attention_plan(
    attention: nn.Module, residual: Placement, replicated_kv: bool = False
) -> dict[str, ParallelStyle]:
    """The attention's styles, keyed by path within the block (GQA or MLA); with
    `replicated_kv` the K and V projections keep their whole weights (`_OneKVHead`)."""
    latent = isinstance(attention, MultiHeadLatentAttention)
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None),
            desired_input_layouts=(Replicate(), None, None),
            # MLA's replicated latent projections take plain tensors.
            use_local_output=latent,
        ),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if latent:
        query = "attention.wq_b" if hasattr(attention, "wq_b") else "attention.wq"
        plan[query] = ColwiseParallel()
        plan["attention.wkv_b"] = ColwiseParallel()
    else:
        for name in ("wq",) if replicated_kv else ("wq", "wk", "wv"):
            plan[f"attention.{name}"] = ColwiseParallel()
    return plan


class _OneKVHead:
    """Forward of a K or V projection whose heads are fewer than tp: this rank's one head,
    from the whole weight every rank holds (see the module's docstring)."""

    def __init__(self, linear: nn.Linear, head: int, head_dim: int, tp_mesh: DeviceMesh) -> None:
        self.linear = linear
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.summed = _SumGradient(tp_mesh)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The input's gradient from this head is this rank's share of a sum over tp, as
        # the column-parallel query projection's is: both are reduced together.
        local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
        weight = self.summed.of(self.linear.weight)[self.rows]
        bias = self.linear.bias
        return F.linear(local, weight, None if bias is None else self.summed.of(bias)[self.rows])


def _mtp_plan() -> dict[str, ParallelStyle]:
    """A multi-token prediction module's norms and projection under sequence parallelism:
    replicated weights over the sequence-sharded embedding and hidden state (their gradients
    are partial sums over tp, completed as the norms' are); the projection hands its block a
    local shard, as a block hands the next."""
    return {
        "enorm": SequenceParallel(),
        "hnorm": SequenceParallel(),
        "eh_proj": SequenceParallel(use_local_output=True),
        "norm": SequenceParallel(),
    }


def _pad_vocab(model: nn.Module, tp: int) -> None:
    vocab = padded_vocab(model.cfg.vocab_size, tp)
    if vocab == model.cfg.vocab_size:
        return
    # A pipeline stage pads only the vocabulary modules it holds.
    if model.tok_embeddings is not None:
        device = model.tok_embeddings.weight.device
        model.tok_embeddings = nn.Embedding(vocab, model.cfg.dim, device=device)
    if model.output is not None:
        device = model.output.weight.device
        model.output = nn.Linear(model.cfg.dim, vocab, bias=False, device=device)


def _resolved(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on the token embedding: its output as a plain tensor.

    The embedding's reduction leaves its output an AsyncCollectiveTensor (the wait is
    deferred to its first use). A compiled block would be traced for that type at layer 0
    and again for the plain tensors the later blocks get, and under AOTAutograd the
    gradient of that input would return plain where the reduction's backward expects a
    DTensor. A non-view op waits and returns a plain tensor that autograd links as usual.
    """
    return output.clone() if type(output) is not torch.Tensor else output


class _VocabParallelEmbedding(ParallelStyle):
    """Split an `nn.Embedding` over the vocabulary (Shard(0)): each TP rank looks up the tokens
    its rows hold (zeros for the others), and the sum over tp arrives in the residual
    stream's `layout` (a reduce-scatter over the sequence under SP, an all-reduce without),
    as a local tensor. The weight's gradient is computed on the rank's rows alone."""

    def __init__(self, layout: Placement) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None)
        module.weight = nn.Parameter(rows)
        module.forward = functools.partial(_lookup, module, device_mesh, self.layout)
        return module


def _lookup(
    module: nn.Module, mesh: DeviceMesh, layout: Placement, tokens: torch.Tensor
) -> torch.Tensor:
    """`module`'s embedding of `tokens` from this rank's rows, summed over tp into `layout`."""
    local = module.weight.to_local()  # its gradient returns as the same Shard(0) DTensor
    first = mesh.get_local_rank() * local.shape[0]
    elsewhere = (tokens < first) | (tokens >= first + local.shape[0])
    found = F.embedding(torch.where(elsewhere, 0, tokens - first), local)
    found = found.masked_fill(elsewhere.unsqueeze(-1), 0)
    # Partial: the full gradient comes back to every rank's rows (from_local's backward).
    summed = DTensor.from_local(found, mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [layout]).to_local()


class _SumGradient:
    """Forward hook: the output unchanged, its gradient summed over the mesh in backward."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.of(output)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` unchanged, its gradient summed over the mesh in backward."""
        shared = DTensor.from_local(tensor, self.mesh, [Replicate()], run_check=False)
        # A partial gradient leaving to_local is reduced to a replicated one by from_local.
        return shared.to_local(grad_placements=[Partial()])


class _VocabMask:
    """Forward hook on the LM head: padded vocabulary entries get -inf logits."""

    def __init__(self, vocab_size: int, tp_mesh: DeviceMesh) -> None:
        self.vocab_size = vocab_size
        self.tp_mesh = tp_mesh
        self.mask: DTensor | None = None

    def __call__(self, module: nn.Module, inputs: tuple, logits: DTensor) -> DTensor:
        if self.mask is None or self.mask.device != logits.device:
            full = torch.zeros(logits.shape[-1], device=logits.device, dtype=logits.dtype)
            full[self.vocab_size :] = float("-inf")
            self.mask = distribute_tensor(full, self.tp_mesh, [Shard(0)], src_data_rank=None)
        return logits + self.mask.to(logits.dtype)


@contextlib.contextmanager
def vocab_parallel_loss(enabled: bool) -> Iterator[None]:
    """Cross-entropy over vocab-sharded logits; forward and backward must both run inside."""
    if not enabled:
        yield
        return
    with loss_parallel():
        yield


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `tensor`'s value (a replicated DTensor's local copy)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
