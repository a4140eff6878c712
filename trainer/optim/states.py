"""Optimizer states kept in fp32, bf16 or block-quantized 8- and 4-bit (`optim.state_dtype`).

The in-repo optimizers (AdamW below for a state dtype other than fp32, Lion, Muon) keep each
state tensor as a `StoredState` of the parameter's local shard and do their math in FP32:
load, update, use the FP32 values for this step's update and store them back (as torchao's
low-bit optimizers do, so rounding only reaches the next step).

- bf16: the state tensor in bfloat16 (round to nearest).
- int8 / int4: blocks of `STATE_BLOCK` elements along the last dim, each with an FP32 scale
  (its largest value, with its sign) and one code per element from a fixed map: the dynamic map of
  Dettmers et al. ("8-bit Optimizers via Block-wise Quantization", 2022) for signed states
  (Adam's first moment, momentum), and for the second moment its square root (half the
  dynamic range of v) in the unsigned dynamic map (int8) or a linear map without zero (int4,
  Li et al. 2023, as torchao's AdamW4bit); int4 packs two codes per byte. Tensors that do not
  split into such blocks (1-D norms and biases, a last dim not a multiple of 32) stay FP32.

Blocks run along the last dim of the local shard, so a block never depends on how FSDP or
tensor parallelism cut the other dims: a layout that keeps every rank's last dim a multiple
of 32 quantizes exactly as one process does, which is what makes these states reproduce
the single-process run under FSDP2 and TP.

Checkpoints hold every state dequantized to FP32, as DTensors laid out like their
parameters: DCP reshards them like any optimizer state, and loading quantizes them again
(`state_dict` / `load_state_dict` below), so a run can resume under another layout, or
another state dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from pretrain.core.optim_states import STATE_BLOCK, STATE_DTYPES
from pretrain.parallel.tensor import local_value


def dynamic_map(signed: bool, exponent_bits: int, total_bits: int) -> list[float]:
    """The dynamic quantization map (a dynamic exponent and a linear fraction per code) of
    Dettmers et al. 2022, as bitsandbytes' `create_dynamic_map` builds it, in [-1, 1]."""
    data: list[float] = []
    fraction_bits = total_bits - 1
    extra = 2 ** (fraction_bits - exponent_bits) - 1
    for i in range(exponent_bits):
        items = 2 ** (i + fraction_bits - exponent_bits + (0 if signed else 1)) + 1
        data += _scaled_means(items, 10 ** (-(exponent_bits - 1) + i), signed)
    if extra > 0:
        data += _scaled_means(extra + 1, 10 ** (-(exponent_bits - 1) + exponent_bits - 1), signed)
    data += [0.0, 1.0]
    return sorted(data)


def _scaled_means(items: int, scale: float, signed: bool) -> list[float]:
    bounds = torch.linspace(0.1, 1, items)
    means = ((bounds[:-1] + bounds[1:]) / 2 * scale).tolist()
    return means + [-m for m in means] if signed else means


@functools.cache
def _code_map(dtype: str, signed: bool) -> tuple[float, ...]:
    if dtype == "int8":
        return tuple(dynamic_map(signed, 7, 8))
    if signed:
        return tuple(dynamic_map(True, 3, 4))
    return tuple(torch.linspace(0, 1, 17)[1:].tolist())  # no zero: sqrt(v) never rounds to 0


class StoredState:
    """One optimizer state tensor of a local shard, kept in `dtype`; read and written in FP32.

    `signed=False` marks a non-negative state (a second moment), which the quantized dtypes
    keep as its square root.
    """

    def __init__(self, like: torch.Tensor, dtype: str, signed: bool = True) -> None:
        if dtype not in STATE_DTYPES:
            raise ValueError(f"optim.state_dtype={dtype!r}: use one of {STATE_DTYPES}")
        self.shape = like.shape
        self.signed = signed
        quantizable = like.ndim >= 2 and like.shape[-1] % STATE_BLOCK == 0 and like.numel()
        self.dtype = dtype if dtype in ("fp32", "bf16") or quantizable else "fp32"
        self.data: torch.Tensor = torch.zeros(0)
        self.scale: torch.Tensor | None = None
        if self.dtype in ("int8", "int4"):
            qmap = torch.tensor(_code_map(self.dtype, signed), device=like.device)
            self.qmap = qmap
            self.midpoints = (qmap[1:] + qmap[:-1]) / 2
        self.set(torch.zeros(like.shape, dtype=torch.float32, device=like.device))

    def get(self) -> torch.Tensor:
        """The state in FP32 (a new tensor unless the state is FP32)."""
        if self.dtype == "fp32":
            return self.data
        if self.dtype == "bf16":
            return self.data.float()
        codes = self.data
        if self.dtype == "int4":
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
        blocks = self.qmap[codes.long()].unflatten(-1, (-1, STATE_BLOCK))
        values = (blocks * self.scale.unsqueeze(-1)).flatten(-2)
        return values if self.signed else values.square()

    def set(self, value: torch.Tensor) -> None:
        """Store the FP32 `value` (rounded to the state dtype)."""
        if self.dtype == "fp32":
            self.data = value if value.dtype == torch.float32 else value.float()
            return
        if self.dtype == "bf16":
            self.data = value.to(torch.bfloat16)
            return
        value = value if self.signed else value.clamp_min(0).sqrt()
        blocks = value.float().unflatten(-1, (-1, STATE_BLOCK))
        # The scale is the block's largest value with its sign, so that value becomes the
        # code of +1 (the signed maps have no -1), and quantizing a dequantized state again
        # gives back the same codes and scales: checkpoints round-trip exactly.
        largest = blocks.abs().argmax(-1, keepdim=True)
        scale = blocks.gather(-1, largest).squeeze(-1)
        scale = torch.where(scale.abs() < 1e-12, torch.full_like(scale, 1e-12), scale)
        codes = torch.bucketize(blocks / scale.unsqueeze(-1), self.midpoints).to(torch.uint8)
        codes = codes.flatten(-2)
        if self.dtype == "int4":
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        self.data, self.scale = codes, scale

    def nbytes(self) -> int:
        """Bytes this state occupies (codes and scales; not the shared code map)."""
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient of `param`'s local shard, laid out like the parameter (a partial sum,
    e.g. a sequence-parallel norm's, is completed first)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


class StoredStateOptimizer(Optimizer):
    """An optimizer whose tensor states are `StoredState`s in `state_dtype`.

    Subclasses name their states and signs in `STATES` and read them with `stored`.
    """

    STATES: ClassVar[dict[str, bool]] = {}
    """State name -> signed."""

    def __init__(self, params: Iterable, defaults: dict, state_dtype: str) -> None:
        self.state_dtype = state_dtype
        super().__init__(params, defaults)

    def stored(self, param: torch.Tensor, name: str) -> StoredState:
        """The state `name` of `param`, created as zeros on first use."""
        state = self.state[param]
        if name not in state:
            state[name] = StoredState(local_value(param), self.state_dtype, self.STATES[name])
        return state[name]

    def step_count(self, param: torch.Tensor) -> torch.Tensor:
        """This parameter's update count after incrementing it (a CPU scalar, as torch's)."""
        state = self.state[param]
        state.setdefault("step", torch.tensor(0.0))
        state["step"] += 1
        return state["step"]

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def float_state(self, param: torch.Tensor) -> dict[str, Any]:
        """`param`'s states in FP32, DTensors laid out like the parameter if it is one."""
        out: dict[str, Any] = {}
        for name, value in self.state.get(param, {}).items():
            if isinstance(value, StoredState):
                value = value.get()
                if isinstance(param, DTensor):
                    value = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
            out[name] = value
        return out

    def load_float_state(self, param: torch.Tensor, values: dict[str, Any]) -> None:
        """Set `param`'s states from FP32 values (as `float_state` returns them)."""
        state = self.state[param]
        for name, value in values.items():
            if name not in self.STATES:
                state[name] = value
                continue
            stored = self.stored(param, name)
            stored.set(local_value(value).to(stored.data.device, torch.float32))

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state dict, every stored state in FP32 (see the module doc)."""
        saved = super().state_dict()
        for index, param in enumerate(self._params()):
            if index in saved["state"]:
                saved["state"][index] = self.float_state(param)
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FP32 states (from `state_dict`) and store them in this state dtype."""
        super().load_state_dict(state_dict)
        for param in self._params():
            values = dict(self.state.get(param, {}))
            for name in self.STATES:
                self.state[param].pop(name, None)
            if values:
                self.load_float_state(param, values)

    def state_nbytes(self) -> int:
        """Bytes of all tensor states (what `optim.state_dtype` sizes)."""
        total = 0
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, StoredState):
                    total += value.nbytes()
                elif isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total


@torch.no_grad()
def adamw_update(
    optimizer: StoredStateOptimizer, param: torch.Tensor, group: dict[str, Any]
) -> None:
    """One AdamW step of `param` (decoupled weight decay, bias-corrected moments) in FP32."""
    grad = local_grad(param).float()
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    step = optimizer.step_count(param).item()
    m_state, v_state = optimizer.stored(param, "exp_avg"), optimizer.stored(param, "exp_avg_sq")
    m = m_state.get().lerp(grad, 1 - beta1)
    v = v_state.get().mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_state.set(m)
    v_state.set(v)
    local = local_value(param)
    if wd:
        local.mul_(1 - lr * wd)
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    local.addcdiv_(m.to(local.dtype), denom.to(local.dtype), value=-lr / (1 - beta1**step))


class AdamW(StoredStateOptimizer):
    """AdamW (Loshchilov & Hutter) with its two moments kept in `state_dtype`; the same update
    as `torch.optim.AdamW` in FP32, parameter by parameter."""

    STATES: ClassVar[dict[str, bool]] = {"exp_avg": True, "exp_avg_sq": False}

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        state_dtype: str = "fp32",
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, state_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one AdamW update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    adamw_update(self, param, group)
        return loss
