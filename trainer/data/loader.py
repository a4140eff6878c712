"""The data a run trains and validates on: prepared datasets, their streams, the loaders.

Every source the recipe names is a prepared dataset (`dataprep/prepare.py`). A local run
prepares a missing one first (rank 0, with `data.workers` processes, while the other ranks
wait for its manifest, showing the wait: `dataprep/waiting.py`); a SLURM run refuses and
names the command that prepares it, so GPU nodes never tokenize. The loaders serve each
data-parallel rank its share of every global batch (`trainer/data/sampler.py`), the same under
any layout, and resume from a small state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.cache_lock import holder_detail, holder_fraction
from pretrain.dataprep.dataset_manifest import read_manifest
from pretrain.dataprep.prepare import dataset_lock, prepare_data
from pretrain.dataprep.sources import (
    DatasetPlace,
    dataset_places,
    resolved_sources,
    source_label,
)
from pretrain.dataprep.waiting import Wait
from pretrain.trainer.data.dataset import PackedSequences, PreparedDataset, TokenStream
from pretrain.trainer.data.sampler import MixtureSampler

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class DataNotPrepared(RuntimeError):
    """A SLURM run found a source without its prepared dataset."""


def _unprepared(places: list[DatasetPlace]) -> DatasetPlace | None:
    return next((p for p in places if read_manifest(p.folder) is None), None)


def _wait_for(
    places: list[DatasetPlace], report: Callable[[str], None], poll_s: float = 0.5
) -> None:
    """Until every dataset's manifest exists (the main rank prepares them), showing the wait:
    whose preparation it is and how far along it says it is."""
    names = ", ".join(repr(p.source.source) for p in places)

    def holder() -> str:
        place = _unprepared(places)
        return holder_detail(dataset_lock(place)) if place is not None else ""

    def fraction() -> float | None:
        place = _unprepared(places)
        return holder_fraction(dataset_lock(place)) if place is not None else None

    what = f"data: waiting for the preparation of {names} (by the main rank)"
    with Wait(what, report, detail=holder, fraction=fraction):
        while _unprepared(places) is not None:
            time.sleep(poll_s)


def open_datasets(
    cfg: RecipeConfig, is_main: bool, report: Callable[[str], None]
) -> list[PreparedDataset]:
    """The prepared datasets of the run's sources (validation source last), preparing them
    on the main rank of a local run if they are missing."""
    places = dataset_places(cfg.data, cfg.model.vocab_size)
    missing = [p for p in places if read_manifest(p.folder) is None]
    if missing and cfg.cluster.backend == "slurm":
        raise DataNotPrepared(
            f"data.source={missing[0].source.source!r} is not prepared (no "
            f"{missing[0].folder}/manifest.json); prepare it first with the same command "
            f"and action=prepare (a CPU-only SLURM job), then submit this run again"
        )
    if missing and is_main:
        prepare_data(cfg, report=report, tty=False)
    elif missing:
        _wait_for(places, report)
    datasets = [PreparedDataset(p.folder) for p in places]
    for place, dataset in zip(places, datasets, strict=True):
        top = dataset.manifest.get("max_token_id", -1)
        if top >= cfg.model.vocab_size:
            raise ValueError(
                f"{place.source.source!r}: its token ids go up to {top} but model.vocab_size "
                f"is {cfg.model.vocab_size}; set model.vocab_size to at least {top + 1}"
            )
    return datasets


@dataclass
class RunData:
    """The run's packed training and validation sequences, one entry per source."""

    train: list[PackedSequences]
    val: list[PackedSequences]
    labels: list[str]
    weights: list[float]
    eos_id: int | None


def packed_data(cfg: RecipeConfig, datasets: list[PreparedDataset]) -> RunData:
    """Training and validation sequences of every source: the validation split of each
    training source, or all of data.val_source (read only when eval.every > 0)."""
    d, seq_len = cfg.data, cfg.train.seq_len
    sources = resolved_sources(d)
    train, val = [], []
    for src, dataset in zip(sources, datasets, strict=False):
        train_regions, val_regions = dataset.split(d.val_fraction)
        train.append(PackedSequences(TokenStream(dataset, train_regions), seq_len, src.source))
        if d.val_fraction > 0 and cfg.eval.every > 0:
            name = f"the validation split of {src.source} (data.val_fraction={d.val_fraction})"
            val.append(PackedSequences(TokenStream(dataset, val_regions), seq_len, name))
    if d.val_source and cfg.eval.every > 0:
        stream = TokenStream(datasets[-1], datasets[-1].everything())
        val = [PackedSequences(stream, seq_len, f"data.val_source={d.val_source}")]
    return RunData(
        train=train,
        val=val,
        labels=[source_label(s, i) for i, s in enumerate(sources)],
        weights=[s.weight for s in sources],
        eos_id=datasets[0].eos_id,
    )


class DataLoader:
    """One data-parallel rank's micro-batches, step after step, resumable from a small state."""

    def __init__(
        self,
        sources: list[PackedSequences],
        sampler: MixtureSampler,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        start_step: int = 0,
    ) -> None:
        """Serve rank `dp_rank` of `dp_size` in micro-batches, starting at `start_step`."""
        if sampler.sizes != [len(s) for s in sources]:
            raise ValueError(
                f"sampler covers {sampler.sizes} sequences but the sources have "
                f"{[len(s) for s in sources]}"
            )
        self.sources = sources
        self.sampler = sampler
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch = micro_batch
        self.step = start_step
        self._shorter: dict[tuple[int, int], PackedSequences] = {}

    def batches(self, step: int) -> Batches:
        """(inputs, targets) per accumulation micro-batch of `step`, each of shape
        (micro_batch, the step's seq_len)."""
        pieces = self.sampler.seq_len_pieces(step)
        out = []
        for sources, indices in self.sampler.rank_micro_batches(
            step, self.dp_rank, self.dp_size, self.micro_batch
        ):
            rows = np.stack(
                [
                    self._sequences(int(s), pieces).sequence(int(i))
                    for s, i in zip(sources, indices, strict=True)
                ]
            )
            seqs = torch.from_numpy(rows)
            out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
        return out

    def _sequences(self, source: int, pieces: int) -> PackedSequences:
        """Source `source`'s sequences cut `pieces` from each full-length one (shorter ones
        over the same tokens under a sequence-length warm-up)."""
        full = self.sources[source]
        if pieces == 1:
            return full
        key = (source, pieces)
        if key not in self._shorter:
            self._shorter[key] = PackedSequences(full.stream, full.seq_len // pieces, full.name)
        return self._shorter[key]

    def next_step(self) -> Batches:
        """The next step's micro-batches; advances the position by one step."""
        batches = self.batches(self.step)
        self.step += 1
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The position (the next step) and what it is valid for; the same on every rank."""
        state = {
            "step": self.step,
            "seed": self.sampler.seed,
            "global_batch": self.sampler.global_batch,
            "sequences": list(self.sampler.sizes),
            "weights": list(self.sampler.weights),
        }
        schedule = self.sampler.schedule()
        if schedule:  # only runs with a schedule save one: earlier checkpoints stay valid
            state["schedule"] = schedule
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuses one saved for another data order."""
        expected = self.state_dict()
        mismatches = [
            f"{key}: saved {state.get(key)}, now {expected.get(key)}"
            for key in ("seed", "global_batch", "sequences", "weights", "schedule")
            if state.get(key) != expected.get(key)
        ]
        if mismatches:
            raise ValueError(
                "data loader state was saved for a different data order ("
                + "; ".join(mismatches)
                + "); resume with the same seed, train.global_batch, data, seq_len and "
                "schedules (train.batch_schedule, seq_len_schedule, data.mixture_schedule), "
                "or start a new run"
            )
        self.step = int(state["step"])


def train_loader(cfg: RecipeConfig, run: RunData, dp_rank: int, dp_size: int) -> DataLoader:
    """This rank's loader of the training sequences, mixed by the sources' weights."""
    sampler = MixtureSampler(
        [len(s) for s in run.train],
        run.weights,
        cfg.train.global_batch,
        cfg.seed,
        ramp=Ramp(cfg.train),
        phases=cfg.data.mixture_schedule,
    )
    return DataLoader(
        run.train, sampler, dp_rank=dp_rank, dp_size=dp_size, micro_batch=cfg.train.micro_batch
    )


def val_loader(cfg: RecipeConfig, run: RunData, dp_rank: int, dp_size: int) -> DataLoader | None:
    """This rank's loader of the validation sequences (in order, the same every evaluation),
    or None when the run has no validation split."""
    if not run.val:
        return None
    weights = run.weights if len(run.val) == len(run.weights) else [1.0]
    sampler = MixtureSampler(
        [len(s) for s in run.val], weights, cfg.train.global_batch, cfg.seed, shuffle=False
    )
    return DataLoader(
        run.val, sampler, dp_rank=dp_rank, dp_size=dp_size, micro_batch=cfg.train.micro_batch
    )


def source_val_loaders(
    cfg: RecipeConfig, run: RunData, dp_rank: int, dp_size: int
) -> dict[str, DataLoader]:
    """Each source's own validation loader (in order), by its label, when the run mixes
    several sources that each hold out a validation split; empty otherwise."""
    if len(run.train) < 2 or len(run.val) != len(run.train):
        return {}
    return {
        label: DataLoader(
            [val],
            MixtureSampler([len(val)], [1.0], cfg.train.global_batch, cfg.seed, shuffle=False),
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch=cfg.train.micro_batch,
        )
        for label, val in zip(run.labels, run.val, strict=True)
    }


def tokens_seen(
    sampler: MixtureSampler, labels: list[str], seq_len: int, steps: int
) -> dict[str, int]:
    """Tokens each source of a mixture supplied to the first `steps` steps (none for one)."""
    if len(labels) < 2:
        return {}
    seen = sampler.sequences_seen(steps)
    return {f"tokens_seen_{label}": n * seq_len for label, n in zip(labels, seen, strict=True)}


def one_process_loader(cfg: RecipeConfig) -> DataLoader:
    """The training loader of a one-process tool (benchmarks, memcheck): dp 1, prepared
    here if needed."""
    datasets = open_datasets(cfg, is_main=True, report=print)
    return train_loader(cfg, packed_data(cfg, datasets), dp_rank=0, dp_size=1)
