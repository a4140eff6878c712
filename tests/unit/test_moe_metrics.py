"""Expert-load metrics: counted per step from the routing, shown on the console and in W&B."""

from __future__ import annotations

import torch

from pretrain import models
from pretrain.core.model_config import ModelConfig
from pretrain.models.init import init_weights
from pretrain.trainer.observe.loggers import console_line, wandb_key
from pretrain.trainer.observe.moe_metrics import expert_load_metrics


def test_tokens_per_expert_average_to_tokens_times_k_over_n_and_reset_after_reading() -> None:
    cfg = ModelConfig(
        vocab_size=64, dim=16, n_heads=2, ffn_dim=32, n_layers=2, moe_experts=4, moe_top_k=2
    )
    model = models.build(cfg)
    init_weights(model, seed=0)
    steps, tokens = 3, 2 * 8
    torch.manual_seed(0)
    for _ in range(steps):
        model(torch.randint(0, 64, (2, 8)))
    metrics = expert_load_metrics(model, None, steps)
    assert metrics["moe_tokens_per_expert_mean"] == tokens * 2 / 4
    assert metrics["moe_tokens_per_expert_min"] <= 8 <= metrics["moe_tokens_per_expert_max"]
    assert metrics["moe_dropped_frac"] == 0.0
    assert expert_load_metrics(model, None, steps) == {}


def test_dense_model_has_no_expert_metrics() -> None:
    model = models.build(ModelConfig(vocab_size=64, dim=16, n_heads=2, ffn_dim=32, n_layers=1))
    assert expert_load_metrics(model, None, 1) == {}


def test_expert_metrics_reach_the_console_and_the_moe_section_of_wandb() -> None:
    metrics = {
        "moe_tokens_per_expert_min": 3.0,
        "moe_tokens_per_expert_mean": 8.0,
        "moe_tokens_per_expert_max": 14.0,
        "moe_dropped_frac": 0.05,
        "moe_aux_loss": 1.02,
    }
    assert "experts load 3/8/14 min/mean/max, dropped 5.0%, aux 1.020" in console_line(
        1, 2, metrics
    )
    assert wandb_key("moe_dropped_frac") == "moe/dropped_frac"
    assert wandb_key("moe_tokens_per_expert_max") == "moe/tokens_per_expert_max"
