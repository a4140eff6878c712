"""Fixtures the unit tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import generated_documents, write_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 320 ids trained on generated documents (the words every test
    corpus of tests/helpers.py draws from), saved as tokenizer.json."""
    docs = generated_documents(600, seed=3)
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", docs)
