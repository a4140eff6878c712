"""Tokenizers: a byte-level BPE trained on the text sources (cached), or one from disk.

`load_tokenizer` returns a `tokenizers.Tokenizer` whose end-of-sequence token is known to
`eos_id`; prepared datasets end every document with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.core.inputs.reading import MissingFile, read_mapping
from pretrain.dataprep.cache_lock import held
from pretrain.dataprep.corpus import source_documents
from pretrain.dataprep.sources import text_sources, tokenizer_file, trained_tokenizer_path
from pretrain.dataprep.waiting import Wait

if TYPE_CHECKING:
    from pretrain.core.schema import DataConfig

EOS_TOKEN = "<|endoftext|>"
"""The end-of-sequence token of tokenizers trained here."""

KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-sequence tokens recognised in a pretrained tokenizer without a tokenizer_config.json."""


def max_token_id(tokenizer: Tokenizer) -> int:
    """The largest id the tokenizer can produce (added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values())


def eos_id(tokenizer: Tokenizer) -> int:
    """Id of the end-of-sequence token: the one `load_tokenizer` found, else a known one."""
    candidates = (getattr(tokenizer, "eos_token", None), *KNOWN_EOS_TOKENS)
    for token in candidates:
        token_id = None if token is None else tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        f"tokenizer has no end-of-sequence token: none of {list(KNOWN_EOS_TOKENS)} is in its "
        f"vocabulary; give a Hugging Face tokenizer directory whose tokenizer_config.json sets "
        f"eos_token"
    )


def _training_text(data: DataConfig) -> Iterator[list[str]]:
    for src in text_sources(data):
        yield from source_documents(src)


def train_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` tokens (EOS included) on the text sources."""
    return train_bpe(_training_text(data), vocab_size)


def train_bpe(batches: Iterable[list[str]], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with `vocab_size` tokens (EOS included) trained on `batches` of text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(batches, trainer=trainer)
    return tokenizer


def trained_tokenizer(
    data: DataConfig,
    vocab_size: int,
    report: Callable[[str], None] = print,
    tty: bool | None = None,
) -> Path:
    """The path of the tokenizer `train` names, training it on first use (showing how long
    it takes). Concurrent callers wait on a file lock while one of them trains, showing the
    wait; readers only ever see a complete file."""
    path = trained_tokenizer_path(data, vocab_size)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = ", ".join(repr(s.source) for s in text_sources(data))
    waiting = f"data: waiting for the tokenizer {path.name} to be trained"
    with held(path.parent / "build.lock", waiting, report, tty) as holding:
        if path.exists():
            return path
        holding.publish(None, f"training a byte-level BPE on {sources}")
        training = f"data: training a byte-level BPE ({vocab_size} tokens) on {sources}"
        with Wait(training, report, tty=tty) as wait:
            tokenizer = train_tokenizer(data, vocab_size)
            tmp = path.with_suffix(".json.tmp")
            tokenizer.save(str(tmp))
            os.replace(tmp, path)
            wait.outcome = (
                f"data: trained byte-level BPE ({tokenizer.get_vocab_size()} tokens) on "
                f"{sources} -> {path}"
            )
    return path


def _pretrained_eos(folder: Path) -> str | None:
    try:
        config = read_mapping(folder / "tokenizer_config.json", "a tokenizer_config.json")
    except MissingFile:
        return None
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # older files store an AddedToken as a dict
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(
    data: DataConfig,
    vocab_size: int,
    report: Callable[[str], None] = print,
    tty: bool | None = None,
) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (training and caching one for `train`), checked to
    fit a model embedding of `vocab_size` rows and to have an end-of-sequence token."""
    if data.tokenizer == "none":
        raise ValueError("data.tokenizer=none: the sources are pre-tokenized; there is none")
    if data.tokenizer == "train":
        path = trained_tokenizer(data, vocab_size, report, tty)
        eos: str | None = EOS_TOKEN
    else:
        path = tokenizer_file(data) or Path()
        if not path.is_file():
            raise FileNotFoundError(
                f"data.tokenizer={data.tokenizer!r}: no tokenizer.json there; give `train`, a "
                f"tokenizer.json file or a Hugging Face tokenizer directory"
            )
        eos = _pretrained_eos(path.parent)
    tokenizer = Tokenizer.from_file(str(path))
    if eos is not None and tokenizer.token_to_id(eos) is None:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r}: eos_token {eos!r} from tokenizer_config.json "
            f"is not in the tokenizer's vocabulary"
        )
    # The Tokenizer object carries the EOS it was loaded with, so eos_id needs nothing else.
    tokenizer.eos_token = eos  # type: ignore[attr-defined]
    eos_id(tokenizer)  # fail now, with the message, if there is none
    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r}: token ids go up to {top} but model.vocab_size "
            f"is {vocab_size}; set model.vocab_size to at least {top + 1}"
        )
    return tokenizer
