"""Document-aware attention: inside a packed sequence each document is computed as if it
ran alone (block-causal attention; rotary embeddings are relative, so positions need no
reset)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.models.init import init_weights
from pretrain.models.layers import document_mask
from pretrain.trainer.step.context import document_ids

EOS = 0
MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=64)  # fmt: skip


def per_token_loss(model: torch.nn.Module, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    logits = model(tokens[None, :-1], **kwargs)[0]
    return F.cross_entropy(logits, tokens[1:], reduction="none")


def test_a_packed_sequence_gives_each_document_the_loss_it_has_alone() -> None:
    model = models.build(MODEL).to_empty(device="cpu")
    model.init_buffers("cpu")
    init_weights(model, seed=0)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(1, 64, (n,), generator=gen), torch.tensor([EOS])])
            for n in (6, 11, 3, 9)]  # fmt: skip
    packed = torch.cat(docs)
    with torch.no_grad():
        masked = per_token_loss(model, packed, doc_ids=document_ids(packed[None, :-1], EOS))
        unmasked = per_token_loss(model, packed)
        start = 0
        for doc in docs:
            alone = per_token_loss(model, doc)
            # Position start + i predicts doc[i + 1]; the EOS before a document predicts
            # its first token from the previous one, which running it alone has no place for.
            torch.testing.assert_close(masked[start : start + len(doc) - 1], alone,
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            start += len(doc)
    # Without the mask, later documents see the earlier ones.
    assert (unmasked - masked).abs().max() > 1e-3


def test_document_ids_split_after_each_end_of_sequence_token() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def test_the_mask_is_causal_inside_a_document_and_closed_across() -> None:
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
