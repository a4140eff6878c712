"""Validation of the compile, overlap and prefetch fields."""

from __future__ import annotations

import pytest

from pretrain.launcher.validate.recipe import validate
from tests.helpers import base, configure, problems

CASES = [
    ({"compile.backend": "tensorrt"}, "compile.backend", "unknown value", "aot_eager or eager"),
    (
        {"compile.enabled": True, "compile.blocks": False, "compile.loss": False},
        "compile.enabled", "nothing would be compiled", "compile.blocks=true",
    ),
    ({"precision.reduce_dtype": "fp16"}, "precision.reduce_dtype", "unknown value", "fp32 or bf16"),
    ({"parallel.fsdp_prefetch": -1}, "parallel.fsdp_prefetch", "must be >= 0", ">= 0"),
    ({"parallel.ddp_bucket_mb": 0.0}, "parallel.ddp_bucket_mb", "must be > 0", "positive"),
    ({"data.prefetch": -2}, "data.prefetch", "must be >= 0", ">= 0"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "field", "reason", "fix"), CASES)
def test_each_speed_rule_reports_field_reason_and_fix(overrides, field, reason, fix):
    found = [p for p in problems(configure(overrides)) if p.field == field]
    assert found, f"no problem on {field}"
    assert reason in found[0].reason and fix in found[0].fix


def test_compile_with_bf16_reduction_and_no_prefetch_is_valid():
    cfg = configure(
        {
            "compile.enabled": True,
            "compile.loss": False,
            "compile.fallback": True,
            "precision.reduce_dtype": "bf16",
            "data.prefetch": 0,
            "parallel.fsdp_prefetch": 0,
        }
    )
    validate(cfg)
    validate(base())
