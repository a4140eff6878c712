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
        ("checkpoint", "async_mode", "fork", r"checkpoint\.async_mode=fork: unknown value.*"),
        ("cluster", "max_restarts", -1, r"cluster\.max_restarts=-1: must be >= 0"),
        ("faults", "max_bad_steps", 0, r"faults\.max_bad_steps=0: must be >= 1"),
        ("faults", "collective_timeout_s", 0.0, r"faults\.collective_timeout_s=0\.0: must be > 0"),
        ("faults", "straggler_lag", -0.5, r"faults\.straggler_lag=-0\.5: must be > 0"),
    ],
)
def test_bad_checkpoint_and_fault_values_are_reported(section, field, value, message) -> None:
    cfg = RecipeConfig()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(RecipeError, match=message):
        validate(cfg)
