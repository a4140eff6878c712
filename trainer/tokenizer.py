"""Tokenizers: a byte-level BPE trained on the corpus (cached), or a pretrained one from disk.

`load_tokenizer` returns a `tokenizers.Tokenizer` whose end-of-sequence token is known to
`eos_id`; the token file separates documents with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.corpus import (
    build_once,
    cache_root,
    corpus_identity,
    identity_hash,
    iter_document_batches,
)

if TYPE_CHECKING:
    from pretrain_core.schema import DataConfig

EOS_TOKEN = "<|endoftext|>"
"""The end-of-sequence token of tokenizers trained here."""

KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-sequence tokens recognised in a pretrained tokenizer without a tokenizer_config.json."""

TRAINER_VERSION = 1
"""Bump when the training recipe below changes, so cached tokenizers are retrained."""


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """Content hash of the tokenizer's serialized `tokenizer.json`: its identity in cache keys."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:20]


def max_token_id(tokenizer: Tokenizer) -> int:
    """The largest id the tokenizer can produce (added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values())


def eos_id(tokenizer: Tokenizer) -> int:
    """Id of the end-of-sequence token: the one `load_tokenizer` found, else a known one."""
    candidates = (getattr(tokenizer, "eos_token", None), *KNOWN_EOS_TOKENS)
    for token in candidates:
        if token is not None and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise ValueError(
        f"tokenizer has no end-of-sequence token: none of {list(KNOWN_EOS_TOKENS)} is in its "
        f"vocabulary; give a Hugging Face tokenizer directory whose tokenizer_config.json sets "
        f"eos_token"
    )


def train_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` tokens (EOS included) on the corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_document_batches(data), trainer=trainer)
    return tokenizer


def _trained_tokenizer_path(data: DataConfig, vocab_size: int) -> Path:
    """Train on first use and cache by (corpus identity, vocab size); concurrent callers
    (ranks starting together) wait on a file lock while one of them trains."""
    key = identity_hash(
        {"corpus": corpus_identity(data), "vocab_size": vocab_size, "version": TRAINER_VERSION}
    )
    folder = cache_root(data) / "tokenizers" / key
    path = folder / "tokenizer.json"

    def build() -> None:
        start = time.perf_counter()
        tokenizer = train_tokenizer(data, vocab_size)
        tmp = folder / "tokenizer.json.tmp"
        tokenizer.save(str(tmp))
        os.replace(tmp, path)  # readers only ever see a complete file
        print(
            f"data: trained byte-level BPE ({tokenizer.get_vocab_size()} tokens) on "
            f"{data.source!r} in {time.perf_counter() - start:.1f}s -> {path}",
            flush=True,
        )

    build_once(path, build)
    return path


def _pretrained_eos(folder: Path) -> str | None:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    if isinstance(eos, dict):  # older files store an AddedToken as a dict
        eos = eos.get("content")
    return eos


def load_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (training and caching one for `train`), checked to
    fit a model embedding of `vocab_size` rows and to have an end-of-sequence token."""
    if data.tokenizer == "train":
        path = _trained_tokenizer_path(data, vocab_size)
        eos = EOS_TOKEN
    else:
        path = Path(os.path.expanduser(data.tokenizer))
        if path.is_dir():
            path = path / "tokenizer.json"
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
    tokenizer.eos_token = eos
    eos_id(tokenizer)  # fail now, with the message, if there is none
    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r}: token ids go up to {top} but model.vocab_size "
            f"is {vocab_size}; set model.vocab_size to at least {top + 1}"
        )
    return tokenizer
