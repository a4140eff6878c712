"""Checkpoint and fault fields: bad values fail validation with the field and a fix."""

from __future__ import annotations

import pytest

from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("checkpoint", "every", -1, r"checkpoint\.every=-1: must be >= 0"),
        ("checkpoint", "keep", 0, r"checkpoint\.keep=0: must be >= 1"),
        ("checkpoint", "hf_every", -1, r"checkpoint\.hf_every=-1: must be >= 0"),
        ("checkpoint", "async_mode", "fork", r"checkpoint\.async_mode=fork: unknown value.*"),
        ("cluster", "max_restarts", -1, r"cluster\.max_restarts=-1: must be >= 0"),
        ("faults", "max_bad_steps", 0, r"faults\.max_bad_steps=0: must be >= 1"),
        ("faults", "collective_timeout_s", 0.0, r"faults\.collective_timeout_s=0\.0: must be > 0"),
        ("faults", "straggler_lag", -0.5, r"faults\.straggler_lag=-0\.5: must be > 0"),
        ("faults", "timeout_factor", 1.5, r"faults\.timeout_factor=1\.5: .*use 2 or more.*or 0"),
        ("faults", "timeout_factor", -1.0, r"faults\.timeout_factor=-1\.0: must be >= 0"),
        ("faults", "timeout_floor_s", 0.0, r"faults\.timeout_floor_s=0\.0: must be > 0"),
        (
            "faults",
            "first_step_timeout_s",
            -1.0,
            r"faults\.first_step_timeout_s=-1\.0: must be >= 0",
        ),
        ("faults", "on_nan", "retry", r"faults\.on_nan=retry: unknown value.*"),
        ("faults", "on_spike", "skip_all", r"faults\.on_spike=skip_all: unknown value.*"),
        ("faults", "on_alert", "skip", r"faults\.on_alert=skip: unknown value.*rollback"),
        ("faults", "spike_factor", 1.0, r"faults\.spike_factor=1\.0: a spike is a loss above"),
        ("faults", "spike_window", 0, r"faults\.spike_window=0: must be >= 1"),
        ("faults", "rollback_lr_factor", 0.0, r"faults\.rollback_lr_factor=0\.0: .*\(0, 1\]"),
        ("faults", "rollback_lr_steps", -1, r"faults\.rollback_lr_steps=-1: must be >= 0"),
    ],
)
def test_bad_checkpoint_and_fault_values_are_reported(section, field, value, message) -> None:
    cfg = RecipeConfig()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(RecipeError, match=message):
        validate(cfg)


def test_a_rollback_without_periodic_checkpoints_is_refused_naming_both_fields() -> None:
    cfg = RecipeConfig()
    cfg.faults.on_spike, cfg.checkpoint.every = "rollback", 0
    with pytest.raises(RecipeError, match=r"faults\.on_spike=rollback: .*checkpoint\.every=0"):
        validate(cfg)


def test_spike_policies_are_refused_under_a_schedule_that_agrees_a_step_late() -> None:
    cfg = RecipeConfig()
    cfg.cluster.gpus_per_node, cfg.parallel.pp, cfg.parallel.pp_schedule = 2, 2, "2bw"
    cfg.faults.on_spike = "skip"
    with pytest.raises(RecipeError, match=r"faults\.on_spike=skip: parallel\.pp_schedule=2bw"):
        validate(cfg)


def test_an_alert_policy_needs_sampled_monitors_with_a_threshold_and_a_checkpoint() -> None:
    cfg = RecipeConfig()
    cfg.faults.on_alert, cfg.checkpoint.every = "rollback", 0
    cfg.logging.stability_every = 0
    cfg.logging.stability_alerts = {"attn_logit_max": 0.0, "z_mean": 0.0, "update_ratio_max": 0.0}
    with pytest.raises(RecipeError) as caught:
        validate(cfg)
    message = str(caught.value)
    assert "faults.on_alert=rollback: a rollback reloads" in message
    assert "logging.stability_every=0 samples none" in message
    assert "every threshold of logging.stability_alerts is 0" in message
    cfg.checkpoint.every, cfg.logging.stability_every = 5, 10
    cfg.logging.stability_alerts = {"grad_norm_max": 50.0}
    validate(cfg)
    cfg.cluster.gpus_per_node, cfg.parallel.pp, cfg.parallel.pp_schedule = 2, 2, "2bw"
    with pytest.raises(RecipeError, match=r"faults\.on_alert=rollback: parallel\.pp_schedule=2bw"):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {("model", "mlp"): "gelu"},
            r"checkpoint\.hf_every=5: the model cannot be exported: model\.mlp=gelu",
        ),
        (
            {("model", "moe_experts"): 8, ("model", "moe_router"): "sigmoid"},
            r"hf_every=5: the model cannot be exported as a Hugging Face MixtralForCausalLM: "
            r"model\.moe_router=sigmoid",
        ),
        (
            {("model", "vocab_size"): 4095, ("parallel", "tp"): 2, ("cluster", "gpus_per_node"): 2},
            r"hf_every=5: parallel\.tp=2 pads the vocabulary of 4095",
        ),
    ],
)
def test_a_hugging_face_folder_every_n_steps_is_refused_for_a_model_no_family_holds(
    overrides, message
) -> None:
    cfg = RecipeConfig()
    cfg.checkpoint.hf_every = 5
    validate(cfg)
    for (section, field), value in overrides.items():
        setattr(getattr(cfg, section), field, value)
    with pytest.raises(RecipeError, match=message):
        validate(cfg)
