"""Rules of context parallelism (`parallel.cp`) and of the V-shaped, zero-bubble and
PipeDream-2BW pipeline schedules: what each needs of the sequence, the chunks and the
micro-batches, and what the trainer cannot combine them with (each refusal says why),
multi-token prediction among them."""

from __future__ import annotations

from math import lcm

from pretrain.core.problems import Checks, Problem, nearby_multiples, or_list
from pretrain.core.schedules import SCHEDULES, V, splits_backward
from pretrain.core.schema import RecipeConfig


def check_context(c: Checks, cfg: RecipeConfig) -> None:
    """cp against the sequence (2cp equal chunks, and each rank's share split over tp under
    SP) and against the loss chunks. MoE layers compose (they route each rank's chunks and
    gather the counts that are per whole sequence), and so do document masks (the ring masks
    each chunk pair by the documents' ids) and MLA (its decompressed keys and values travel
    the ring): parallel/context.py."""
    p, t = cfg.parallel, cfg.train
    if p.cp <= 1 or t.seq_len < 1:
        return
    chunks = 2 * p.cp
    if t.seq_len % chunks:
        c.add(
            "train.seq_len",
            t.seq_len,
            f"context parallelism cuts each sequence into 2cp = {chunks} equal chunks "
            f"(cp rank i takes chunks i and {chunks - 1}-i)",
            f"use a multiple of {chunks}, e.g. {or_list(nearby_multiples(t.seq_len, chunks))}",
        )
    elif p.sp and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        step = p.cp * p.tp
        c.add(
            "train.seq_len",
            t.seq_len,
            f"sequence parallelism splits each cp rank's {t.seq_len // p.cp} tokens over "
            f"tp={p.tp} ranks evenly",
            f"use a multiple of 2cp and of cp*tp = {step}, "
            f"e.g. {or_list(nearby_multiples(t.seq_len, lcm(chunks, step)))}",
        )
    local = t.seq_len // p.cp
    if not t.seq_len % chunks and t.loss_chunks > 1 and local % t.loss_chunks:
        c.add(
            "train.loss_chunks",
            t.loss_chunks,
            f"the loss is chunked over each cp rank's {local} tokens, which it does not divide",
            f"use a divisor of {local}",
        )


def check_schedule(c: Checks, cfg: RecipeConfig) -> None:
    """The V schedules' two chunks per rank, and 2BW's need of a pipeline (its one chunk per
    rank is the general rule that only interleaved schedules take vpp > 1). Every schedule
    evaluates (the validation loss is a forward-only pass of the trainer's own, outside the
    schedule) and takes tied embeddings and the chunked loss."""
    p = cfg.parallel
    t = SCHEDULES.get(p.pp_schedule)
    if t is None:  # refused as a choice
        return
    if p.pp == 1:
        if not t.flushes:
            c.add(
                "parallel.pp_schedule",
                p.pp_schedule,
                f"{t.title} keeps a pipeline full across optimizer steps; with pp=1 there is "
                "no pipeline, and its one-step-late updates would change training for nothing",
                "set parallel.pp > 1, or pp_schedule=1f1b",
            )
        return
    if t.placement == V and p.vpp != t.chunks_per_rank:
        c.add(
            "parallel.vpp",
            p.vpp,
            f"{p.pp_schedule} places exactly two chunks on each rank, in a V (rank r holds "
            "stages r and 2pp-1-r)",
            f"set parallel.vpp={t.chunks_per_rank}",
        )


def check_mtp(c: Checks, cfg: RecipeConfig) -> None:
    """Multi-token prediction (`model.mtp_layers`) rolls each sequence's tokens by its
    depths, so it needs whole sequences on a rank (no cp), and its modules live on the last
    pipeline stage, which keeps a copy of the embedding: not beside 2BW's two weight
    versions, nor as a tied head's on the embedding's own rank (the V schedules); the
    split-backward schedules run one depth only."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_layers <= 0:
        return
    if p.cp > 1:
        c.add(
            "model.mtp_layers",
            m.mtp_layers,
            f"the tokens ahead of a position lie in other context-parallel chunks (cp={p.cp}), "
            "which the rank does not hold",
            "set parallel.cp=1, or model.mtp_layers=0",
        )
    t = SCHEDULES.get(p.pp_schedule)
    if p.pp == 1 or t is None:
        return
    if t.split_backward and m.mtp_layers > 1:
        c.add(
            "model.mtp_layers",
            m.mtp_layers,
            f"{p.pp_schedule} splits each backward into an input pass and a weight pass "
            "(torch.distributed.pipelining), whose weight pass fails over depths that share "
            "the embedding and the head one after another: it frees the graph of one "
            "before the next reads it",
            "use model.mtp_layers=1 (DeepSeek-V3's), or pp_schedule=1f1b or interleaved_1f1b",
        )
    elif t.placement == V and m.tie_embeddings:
        c.add(
            "model.mtp_layers",
            m.mtp_layers,
            f"{p.pp_schedule} puts the last stage on the embedding's rank, where the tied head "
            "would be the copy of the embedding the MTP modules keep beside it: a second "
            "weight of the same name",
            "set model.tie_embeddings=false, or use pp_schedule=1f1b or interleaved_1f1b",
        )
    elif t.weight_versions > 1:
        c.add(
            "model.mtp_layers",
            m.mtp_layers,
            f"{p.pp_schedule} keeps two weight versions, and the MTP modules' copy of the "
            "embedding is kept alike with the first stage's only at a flush",
            "use pp_schedule=1f1b or interleaved_1f1b, or model.mtp_layers=0",
        )


def runnable_problems(cfg: RecipeConfig) -> list[Problem]:
    """Combinations the trainer cannot execute, with the reason each fails."""
    p = cfg.parallel
    found = []
    if splits_backward(p.pp, p.pp_schedule) and cfg.recompute.policy == "selective":
        found.append(
            Problem(
                "recompute.policy",
                "selective",
                f"{p.pp_schedule} runs each micro-batch's backward twice, for input and then "
                "weight gradients, and torch's selective checkpoint hands each kept tensor to "
                "one backward only ('Trying to backward an extra time ... selective activation "
                "checkpoint', torch 2.13)",
                "use recompute.policy=full or none, or pp_schedule=1f1b, interleaved_1f1b or 2bw",
            )
        )
    return found
