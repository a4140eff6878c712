"""Rules of the data, validation, downstream task and initialization fields.

The field rules hold anywhere. What needs the disk (the sources' files, the tokenizer, the
cache dir, a Hugging Face checkpoint) is checked for a local launch or a local prepare,
where this machine sees the data. A SLURM run is submitted only once its datasets are
prepared (`unprepared_problems`, asked after validation like the memory fit), since its
ranks never tokenize.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pretrain.core.hf.llama import checkpoint_problems
from pretrain.core.inputs.reading import ReadError
from pretrain.core.problems import Checks, Problem, install_fix, installed
from pretrain.core.schema import DATA_FORMATS, RecipeConfig
from pretrain.dataprep.checks import check_data_on_disk, source_fields, unprepared
from pretrain.dataprep.sources import SourceError, resolved_sources, source_label
from pretrain.dataprep.tasks import AVERAGE, is_lm_eval, read_task, task_name

PREPARE_FIX = (
    "prepare it first: the same command with action=prepare (on SLURM a CPU-only job; "
    "cluster.cpu_partition picks its partition)"
)


def check_data(c: Checks, cfg: RecipeConfig, for_launch: bool) -> None:
    """Every data, eval and init rule; with `for_launch`, those that read the disk too."""
    d = cfg.data
    for name in ("max_bytes", "max_tokens", "vocab_size", "workers"):
        c.at_least(f"data.{name}", getattr(d, name), 0)
    sequence = cfg.train.seq_len + 1  # a sequence's inputs and its shifted targets
    for field, limit in [("data.max_tokens", d.max_tokens)] + [
        (f"data.sources[{i}].max_tokens", s.max_tokens) for i, s in enumerate(d.sources)
    ]:
        if 0 < limit < sequence:
            c.add(field, limit, f"fewer tokens than one training sequence of train.seq_len + 1 "
                  f"= {sequence}: the ranks would find nothing to train on",
                  f"use 0 (all of the source) or at least {sequence}")  # fmt: skip
    if not 0 <= d.val_fraction < 1:
        c.add("data.val_fraction", d.val_fraction, "must lie in [0, 1)", "use e.g. 0.005, or 0")
    if d.val_fraction and d.val_source:
        c.add(
            "data.val_source",
            d.val_source,
            "and data.val_fraction both give a validation split",
            "keep one: data.val_fraction=0 or data.val_source=''",
        )
    if not d.sources and not d.source.strip():
        c.add(
            "data.source",
            d.source,
            "is empty: a run needs at least one source",
            "name a file, directory, glob, stdlib or hf:NAME, or give data.sources",
        )
    _check_mixture(c, cfg)
    _check_eval(c, cfg)
    check_tasks(c, cfg, for_launch)
    _check_known_before_the_ranks(c, cfg)
    if d.doc_mask and d.tokenizer == "none":
        c.add(
            "data.doc_mask",
            True,
            "documents are split at the end-of-sequence token, and data.tokenizer=none has none",
            "give the sources' tokenizer",
        )
    if for_launch and cfg.cluster.backend == "local":
        check_data_on_disk(c, cfg)
        _check_hf_checkpoint(c, cfg)


BYTE_BPE_MIN_VOCAB = 257
"""A byte-level BPE trained here holds the 256 byte tokens and EOS before any merge."""


def _check_known_before_the_ranks(c: Checks, cfg: RecipeConfig) -> None:
    """What the ranks (or the preparation) would fail on, known from the recipe alone."""
    for field, src in source_fields(cfg):
        if src.source.startswith("hf:"):
            name = src.source[len("hf:") :].partition(":")[0]
            if not name.strip() or name != name.strip():
                fix = "write hf:NAME or hf:NAME:CONFIG, e.g. hf:roneneldan/TinyStories"
                c.add(field, src.source, "names no hub dataset after 'hf:'", fix)
    if cfg.data.tokenizer == "train" and 0 < cfg.model.vocab_size < BYTE_BPE_MIN_VOCAB:
        c.add("model.vocab_size", cfg.model.vocab_size,
              "a byte-level BPE trained here (data.tokenizer=train) has 256 byte tokens and "
              "EOS before its first merge", f"use at least {BYTE_BPE_MIN_VOCAB}, e.g. 512, or "
              "give a tokenizer")  # fmt: skip


def prepare_problems(cfg: RecipeConfig) -> list[Problem]:
    """What `action=prepare` refuses beyond `validate`: locally, what the disk shows."""
    c = Checks()
    if cfg.cluster.backend == "local":
        check_data_on_disk(c, cfg)
    return c.problems


def _check_mixture(c: Checks, cfg: RecipeConfig) -> None:
    """Each source of data.sources: a format we read, a positive weight, sane limits, a
    label of its own in the metrics."""
    for i, src in enumerate(cfg.data.sources):
        at = f"data.sources[{i}]"
        if not src.source.strip():
            c.add(f"{at}.source", src.source, "is empty", "name a file, directory, glob or hf:NAME")
        c.choice(f"{at}.format", src.format, DATA_FORMATS)
        if not (math.isfinite(src.weight) and src.weight > 0):
            c.add(
                f"{at}.weight",
                src.weight,
                "must be a positive number",
                "give each source its share, e.g. 0.3 and 0.7",
            )
        for name in ("max_bytes", "max_tokens", "vocab_size"):
            c.at_least(f"{at}.{name}", getattr(src, name), 0)
    sources = resolved_sources(cfg.data)
    labels = [source_label(s, i) for i, s in enumerate(sources)]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            c.add(
                f"data.sources[{i}].name",
                sources[i].name,
                f"the metrics label {label!r} is also source {labels.index(label)}'s",
                "give the sources distinct names",
            )


def _check_eval(c: Checks, cfg: RecipeConfig) -> None:
    e, d = cfg.eval, cfg.data
    c.at_least("eval.every", e.every, 0)
    c.at_least("eval.batches", e.batches, 1)
    if e.every > 0 and not (d.val_fraction > 0 or d.val_source):
        c.add(
            "eval.every",
            e.every,
            "there is no validation split to evaluate on",
            "set data.val_fraction (e.g. 0.005) or data.val_source, or eval.every=0",
        )


def _check_hf_checkpoint(c: Checks, cfg: RecipeConfig) -> None:
    """init.from_hf names a Llama directory whose config and tensor shapes fit the model."""
    if not cfg.init.from_hf:
        return
    folder = Path(os.path.expanduser(cfg.init.from_hf))
    if not folder.is_dir():
        c.add(
            "init.from_hf",
            cfg.init.from_hf,
            "no such directory",
            "give a Hugging Face Llama directory (config.json + *.safetensors)",
        )
        return
    for problem in checkpoint_problems(folder, cfg.model):
        c.add(
            "init.from_hf",
            cfg.init.from_hf,
            problem,
            "use a checkpoint of this model's shape, or change model.* to match it",
        )


def unprepared_problems(cfg: RecipeConfig) -> list[Problem]:
    """A SLURM run reads prepared datasets only: one problem per source not prepared yet."""
    c = Checks()
    try:
        missing = unprepared(cfg)
    except (OSError, SourceError) as exc:
        field, src = next(iter(source_fields(cfg)))
        c.add(field, src.source, f"cannot be found from here ({exc})", PREPARE_FIX)
        return c.problems
    for field, place in missing:
        c.add(
            field,
            place.source.source,
            f"not prepared (no {place.folder}/manifest.json)",
            PREPARE_FIX,
        )
    return c.problems


def check_tasks(c: Checks, cfg: RecipeConfig, for_launch: bool) -> None:
    """eval.tasks and when they run; with `for_launch` on this machine, the files too."""
    e = cfg.eval
    c.at_least("eval.tasks_every", e.tasks_every, 0)
    if e.tasks and e.tasks_every == 0:
        c.add("eval.tasks_every", 0, f"the {len(e.tasks)} eval.tasks would never be scored",
              "set eval.tasks_every (e.g. 500), or eval.tasks=[]")  # fmt: skip
    if e.tasks_every > 0 and not e.tasks:
        c.add("eval.tasks_every", e.tasks_every, "there are no eval.tasks to score",
              "name task files in eval.tasks, or set eval.tasks_every=0")  # fmt: skip
    if e.tasks and cfg.data.tokenizer == "none":
        c.add("eval.tasks", e.tasks, "tasks are text, and data.tokenizer=none reads none",
              "give the sources' tokenizer in data.tokenizer, or eval.tasks=[]")  # fmt: skip
    names = [task_name(entry) for entry in e.tasks]
    local = for_launch and cfg.cluster.backend == "local"
    for i, entry in enumerate(e.tasks):
        at = f"eval.tasks[{i}]"
        if names[i] == AVERAGE:
            c.add(at, entry, f"its metrics name {AVERAGE!r} is the tasks' mean's",
                  "rename the file")  # fmt: skip
        if names[i] in names[:i]:
            first = names.index(names[i])
            c.add(at, entry, f"its metrics name {names[i]!r} is also eval.tasks[{first}]'s",
                  "rename one of the files")  # fmt: skip
        if is_lm_eval(entry):
            if not installed("lm_eval"):
                c.add(at, entry, "the lm-eval package is not installed",
                      f"{install_fix('lm_eval')}, or give a JSONL task file")  # fmt: skip
        elif local:
            try:
                read_task(entry)
            except ReadError as err:
                c.add(at, entry, f"{err.found}; expected {err.expected}", err.fix)
    include = e.lm_eval_include
    if include and local and not Path(os.path.expanduser(include)).is_dir():
        c.add("eval.lm_eval_include", include, "no such directory",
              "give the folder of your lm-eval task YAML files, or ''")  # fmt: skip
