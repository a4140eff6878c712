"""Precision of compute: bf16 and fp16 autocast, FP8 linear layers, dynamic loss scaling.

- bf16: autocast (or FSDP2's MixedPrecisionPolicy, which casts the weights), FP32 master
  weights and FP32 gradient reduction.
- fp16: the same in float16, with `LossScaler`: the loss is multiplied by a scale before
  backward, gradients are unscaled before clipping, and a step whose gradients overflowed is
  skipped while the scale backs off; after enough clean steps the scale grows again.
- fp8: the transformer blocks' linear layers compute in FP8, everything else (embedding, norms,
  attention softmax, LM head, a MoE layer's router, master weights, optimizer) stays as bf16
  runs it. Two backends: torchao (per-tensor and rowwise scaling swap in its `Float8Linear`,
  which composes with FSDP2, optionally all-gathering FP8 weights; MXFP8 and 128 x 128 block
  FP8 its block-scaled matmuls, `parallel/fp8_linear.py`; `emulate` runs all but the block
  FP8 on CPU)
  and Transformer Engine (swaps in `te.Linear` and runs the forward under `fp8_autocast`
  with the recipe's scaling). Under torchao the routed experts of a MoE model run through
  its FP8 grouped GEMM where the scaling has one (`parallel/fp8_experts.py`). Transformer
  Engine is imported only when a recipe asks for it, so nothing here needs it on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pretrain.core.precision import (
    BACKEND_INSTALL,
    BACKEND_MODULES,
    FP8_MULTIPLE,
    fp8_experts,
    scaling_multiple,
)
from pretrain.core.schema import PrecisionConfig
from pretrain.models.moe import GroupedExperts
from pretrain.parallel.fp8_experts import Fp8Experts
from pretrain.parallel.fp8_linear import BlockScaledLinear

COMPUTE_DTYPES = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}
"""The dtype autocast / FSDP compute in; under fp8 that is what the non-FP8 parts run in."""


def compute_dtype(precision: PrecisionConfig) -> torch.dtype | None:
    """The low-precision compute dtype of `precision`, or None for plain fp32."""
    return COMPUTE_DTYPES[precision.dtype]


def require_backend(precision: PrecisionConfig) -> None:
    """Fail with what to install when the FP8 backend cannot be imported on this rank."""
    module = BACKEND_MODULES[precision.fp8_backend]
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(
            f"precision.fp8_backend={precision.fp8_backend}: cannot import {module} ({error}); "
            f"{BACKEND_INSTALL[precision.fp8_backend]}"
        ) from error


ROUTER = "router"
"""A MoE layer's router (models/moe.py): its logits pick the experts, so it never runs in FP8,
whatever its shape."""


def fp8_candidate(module: nn.Module, fqn: str, multiple: int = FP8_MULTIPLE) -> bool:
    """Whether `module` (at `fqn`) computes in FP8: the linear layers inside the transformer
    blocks whose widths are multiples of `multiple` (the scaling's, `scaling_multiple`),
    less MoE routers. The LM head and everything outside `layers` stay in high precision."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith("layers.")
        and fqn.rpartition(".")[2] != ROUTER
        and module.in_features % multiple == 0
        and module.out_features % multiple == 0
    )


def apply_precision(model: nn.Module, precision: PrecisionConfig) -> list[str]:
    """Swap the blocks' linear layers for FP8 ones when `precision.dtype=fp8`, and give the
    routed experts their FP8 grouped GEMM where the scaling has one, in place.

    Works on a meta-device model before any other parallelism; parameter names are kept, so
    initialization and checkpoints do not depend on the precision. Returns the swapped
    names: linear layers, and expert modules whose grouped GEMM runs in FP8.
    """
    if precision.dtype != "fp8":
        return []
    require_backend(precision)
    multiple = scaling_multiple(precision.fp8_recipe)
    names = [fqn for fqn, module in model.named_modules() if fp8_candidate(module, fqn, multiple)]
    if precision.fp8_backend == "te":
        import transformer_engine.pytorch as te

        _swap_linears(model, names, lambda old: te.Linear(
            old.in_features, old.out_features, bias=old.bias is not None,
            params_dtype=old.weight.dtype, device=old.weight.device,
        ))  # fmt: skip
    elif precision.fp8_recipe in ("current", "rowwise"):
        _convert_torchao_float8(model, precision)
    else:
        recipe, emulate = precision.fp8_recipe, precision.fp8_emulate
        _swap_linears(model, names, lambda old: BlockScaledLinear(old, recipe, emulate))
    if fp8_experts(precision):
        for fqn, module in model.named_modules():
            if isinstance(module, GroupedExperts):
                module.kernel = Fp8Experts(precision.fp8_recipe, precision.fp8_emulate)
                names.append(fqn)
    return names


def _convert_torchao_float8(model: nn.Module, precision: PrecisionConfig) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = {"current": "tensorwise", "rowwise": "rowwise"}[precision.fp8_recipe]
    config = Float8LinearConfig.from_recipe_name(recipe)
    # from_recipe_name fixes the casts; emulation and FP8 all-gather are ours to set.
    config = dataclasses.replace(
        config,
        emulate=precision.fp8_emulate,
        enable_fsdp_float8_all_gather=precision.fp8_all_gather,
    )
    convert_to_float8_training(model, module_filter_fn=fp8_candidate, config=config)


def _swap_linears(
    model: nn.Module, names: list[str], build: Callable[[nn.Linear], nn.Module]
) -> None:
    """Replace each linear layer named in `names` by `build(old)`."""
    for fqn in names:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, build(getattr(parent, child)))


def _te_recipe(precision: PrecisionConfig):
    from transformer_engine.common import recipe

    if precision.fp8_recipe == "delayed":
        return recipe.DelayedScaling(
            fp8_format=recipe.Format.HYBRID,
            amax_history_len=precision.fp8_amax_history,
            amax_compute_algo="max",
            margin=precision.fp8_margin,
        )
    if precision.fp8_recipe == "mxfp8":
        return recipe.MXFP8BlockScaling()
    if precision.fp8_recipe == "blockwise":
        # DeepSeek-V3's: 1 x 128 activation tiles, 128 x 128 weight blocks.
        return recipe.Float8BlockScaling()
    return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)


def forward_context(
    precision: PrecisionConfig, device: torch.device, weights_cast: bool
) -> contextlib.AbstractContextManager:
    """The context the forward runs in: autocast to the compute dtype unless FSDP already
    casts the weights (`weights_cast`), plus Transformer Engine's `fp8_autocast` for TE."""
    dtype = compute_dtype(precision)
    stack = contextlib.ExitStack()
    stack.enter_context(
        torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=bool(dtype))
        if not weights_cast
        else contextlib.nullcontext()
    )
    if precision.dtype == "fp8" and precision.fp8_backend == "te":
        import transformer_engine.pytorch as te

        stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=_te_recipe(precision)))
    return stack


def after_optimizer_step(model: nn.Module, precision: PrecisionConfig) -> None:
    """torchao's FP8 all-gather: compute every weight's FP8 scale in one pass for the next
    step's all-gathers (otherwise each rank would need its own amax all-reduce per weight)."""
    if precision.dtype == "fp8" and precision.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


class LossScaler:
    """Dynamic loss scaling for fp16; with `enabled=False` every method is the identity.

    The overflow test is the global gradient norm from `parallel.clip`, which is already
    summed over every rank that holds a shard, so all ranks skip or take a step together.
    """

    def __init__(self, precision: PrecisionConfig) -> None:
        self.enabled = precision.dtype == "fp16"
        self.scale = precision.loss_scale_init if self.enabled else 1.0
        self.growth = precision.loss_scale_growth
        self.backoff = precision.loss_scale_backoff
        self.interval = precision.loss_scale_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale (what backward runs on)."""
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, parameters: Iterable[nn.Parameter]) -> None:
        """Divide every gradient by the scale, in place (local shards of DTensor gradients)."""
        if not self.enabled:
            return
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in parameters
            if p.grad is not None
        ]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, global_grad_norm: torch.Tensor) -> bool:
        """Adjust the scale after a backward; True when the optimizer should step.

        A non-finite norm means some gradient overflowed: skip the step and back off.
        """
        if not self.enabled:
            return True
        if not math.isfinite(global_grad_norm.item()):
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.scale *= self.growth
            self.clean_steps = 0
        return True

    def metrics(self) -> dict[str, float]:
        """`loss_scale` and `skipped_steps` (since the start of the run) under fp16."""
        if not self.enabled:
            return {}
        return {"loss_scale": self.scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint needs to resume the scaler exactly."""
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore `state_dict()`."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
