"""Validation of multi-head latent attention and of the optimizer's new fields."""

from __future__ import annotations

import pytest

from pretrain.launcher.validate.recipe import validate
from tests.helpers import configure, problems

MLA = {"model.attention": "mla", "model.n_kv_heads": 0}


def test_an_mla_recipe_with_tensor_parallelism_and_muon_with_int8_states_is_valid() -> None:
    validate(
        configure(
            {**MLA, "parallel.tp": 2, "parallel.zero": 2, "optim.name": "muon",
             "optim.state_dtype": "int8"}
        ),
        for_launch=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"model.attention": "linear"}, "model.attention", "unknown value 'linear'"),
        ({**MLA, "model.n_kv_heads": 8}, "model.n_kv_heads", "no key/value heads to group"),
        ({**MLA, "model.mla_kv_rank": -1}, "model.mla_kv_rank", "must be >= 0"),
        ({**MLA, "model.mla_rope_dim": 7}, "model.mla_rope_dim", "pairs of dims; 7 is odd"),
        ({"optim.name": "adafactor"}, "optim.name", "unknown value 'adafactor'"),
        ({"optim.state_dtype": "fp8"}, "optim.state_dtype", "unknown value 'fp8'"),
        (
            {"optim.name": "sgd", "optim.state_dtype": "bf16"},
            "optim.state_dtype",
            "SGD is torch's",
        ),
    ],
)
def test_bad_attention_or_optimizer_value_is_refused_with_its_reason(
    overrides, field, message
) -> None:
    found = [p for p in problems(configure(overrides)) if p.field == field]
    assert len(found) == 1
    assert message in found[0].reason
