"""A vocabulary tp does not divide is padded with zero rows; the real rows keep their init."""

import pytest
import torch
from torch import nn

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.models.init import initial_value
from pretrain.parallel.materialize import materialize
from pretrain.parallel.tensor import padded_vocab


@pytest.mark.parametrize(("vocab", "tp", "expected"), [(512, 4, 512), (510, 4, 512), (509, 2, 510)])
def test_padded_vocab_is_the_next_multiple_of_tp(vocab, tp, expected):
    assert padded_vocab(vocab, tp) == expected


def test_padded_rows_are_zero_and_real_rows_match_the_unpadded_init():
    cfg = ModelConfig(vocab_size=510, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=16)
    model = models.build(cfg)
    padded = padded_vocab(cfg.vocab_size, 4)
    with torch.device("meta"):
        model.tok_embeddings = nn.Embedding(padded, cfg.dim)
        model.output = nn.Linear(cfg.dim, padded, bias=False)
    materialize(model, cfg, seed=7, device=torch.device("cpu"))
    for name in ("tok_embeddings.weight", "output.weight"):
        weight = model.get_parameter(name)
        real = initial_value(cfg, name, (cfg.vocab_size, cfg.dim), seed=7)
        assert torch.equal(weight[: cfg.vocab_size], real)
        assert torch.count_nonzero(weight[cfg.vocab_size :]) == 0
