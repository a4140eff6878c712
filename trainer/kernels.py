"""Which kernels the step runs: the attention backend SDPA picks and the optimizer path.

Reported once at start, so a run on a GPU says whether attention took the flash or the
memory-efficient kernel (or fell back to the slow math path) before anyone reads its MFU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.core.model_config import ModelConfig
from pretrain.models.moe import grouped_mm_supported
from pretrain.parallel.zero.offload import offloaded_modules
from pretrain.trainer.allocator import freed_memory_kept

if TYPE_CHECKING:
    from pretrain.core.schema import RecipeConfig
    from pretrain.trainer.step.state import TrainState

# The aten op SDPA dispatches to, by backend.
SDPA_BACKENDS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device-specific)",
}


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def sdpa_backend(model: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> str:
    """The SDPA backend that runs the model's causal GQA attention at these shapes.

    One attention call on a single sequence of random tensors, with gradients on as in
    training; the aten op it dispatches to names the backend ("math" when none of the fused
    ones accepted the inputs).
    """

    def tensor(heads: int, width: int) -> torch.Tensor:
        return torch.randn(1, heads, seq_len, width, device=device, dtype=dtype, requires_grad=True)

    q, k = tensor(model.n_heads, model.qk_head_dim), tensor(model.kv_heads, model.qk_head_dim)
    v = tensor(model.kv_heads, model.v_head_dim)
    with _RecordOps() as record:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for op in record.ops:
        if op in SDPA_BACKENDS:
            return SDPA_BACKENDS[op]
    return "math"


def optimizer_path(optimizer: torch.optim.Optimizer) -> str:
    """fused, foreach or for-loop: how the optimizer's step is implemented."""
    defaults = getattr(optimizer, "defaults", {})
    if defaults.get("fused"):
        return "fused"
    if defaults.get("foreach"):
        return "foreach"
    return "for-loop"


def kernels_line(cfg: RecipeConfig, state: TrainState, device: torch.device) -> str:
    """One start-up line: attention backend, optimizer path, compile, data prefetch."""
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32
    if cfg.data.doc_mask:
        # Block-causal over packed documents: FlexAttention on CUDA, SDPA with a mask elsewhere.
        attention = "flex (document mask)" if device.type == "cuda" else "SDPA with a document mask"
    else:
        attention = sdpa_backend(cfg.model, cfg.train.seq_len, device, dtype)
    k = cfg.compile
    compiled = [name for name, on in (("blocks", k.blocks), ("loss", k.loss)) if on]
    compile_text = f"{'+'.join(compiled)} ({k.backend})" if k.enabled else "off"
    prefetch = f"{cfg.data.prefetch} steps ahead" if cfg.data.prefetch else "off"
    states = f" ({cfg.optim.state_dtype} states)" if cfg.optim.state_dtype != "fp32" else ""
    host = offloaded_modules(state.plain)
    return (
        f"kernels: attention {attention}, optimizer {optimizer_path(state.optimizer)}"
        f"{states}, {experts_path(cfg, device, dtype)}compile {compile_text}, "
        f"data prefetch {prefetch}, gradient reduction {cfg.precision.reduce_dtype}"
        + (f", {host} FSDP units offloaded to host memory" if host else "")
        + (", freed host memory kept for reuse" if freed_memory_kept() else "")
    )


def experts_path(cfg: RecipeConfig, device: torch.device, dtype: torch.dtype) -> str:
    """'experts grouped GEMM, ' or 'experts loop, ' for a MoE model (empty for a dense one):
    whether the device runs `torch._grouped_mm` for the dtype and the experts' widths (and,
    in compiled blocks, whether torch.compile can trace it: bf16 only)."""
    model = cfg.model
    if not model.moe_experts:
        return ""
    rows = torch.empty(1, model.dim, device=device, dtype=dtype)
    grouped = model.moe_gemm == "grouped" and grouped_mm_supported(rows, model.expert_ffn_dim)
    if cfg.compile.enabled and cfg.compile.blocks and dtype != torch.bfloat16:
        grouped = False
    return f"experts {'grouped GEMM' if grouped else 'loop'}, "
