"""`init.from_hf=DIR`: start from a Hugging Face checkpoint (Llama, Qwen2/3, Mistral,
Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), under any layout.

After the model is materialized (`parallel/materialize.py`), every parameter this rank holds
(and a MoE layer's balancing bias, DeepSeek-V3's e_score_correction_bias) is overwritten with
the checkpoint's tensor of the same name (`core/hf/llama.py` maps the names,
`hf_tensors.py` the layouts), cast to the parameter's dtype; a sharded (DTensor) parameter
keeps only its own slice, so TP, PP, FSDP and their mixes all start from the same weights.
Tensors are read one at a time from the safetensors files (memory-mapped), never the whole
model at once. Vocabulary rows that tensor parallelism pads are zeros, as at
initialization. The directory is checked against the recipe first (config.json and every
tensor's shape).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain.core.hf.llama import checkpoint_problems, hf_name, safetensors_files
from pretrain.core.hf.moe import rotary_interleaved
from pretrain.core.inputs.reading import read_mapping
from pretrain.core.model_config import ModelConfig
from pretrain.trainer.checkpoint.hf_tensors import from_hf


def _fit_rows(full: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`full` with zero rows appended up to `shape` (a vocabulary padded for TP)."""
    if full.shape[0] == shape[0]:
        return full
    return torch.cat([full, full.new_zeros(shape[0] - full.shape[0], *full.shape[1:])])


@torch.no_grad()
def load_hf_weights(model: nn.Module, cfg: ModelConfig, folder: str | Path) -> int:
    """Overwrite `model`'s parameters and balancing biases (a plain model, a pipeline stage
    view, sharded or not) with the checkpoint's, all but the multi-token prediction
    modules'; returns how many were loaded."""
    folder = Path(folder).expanduser()
    problems = checkpoint_problems(folder, cfg)
    if problems:
        raise ValueError(f"init.from_hf={folder}: " + "; ".join(problems))
    interleaved = rotary_interleaved(read_mapping(folder / "config.json", "a config.json"))
    handles = [
        safe_open(str(path), framework="pt", device="cpu") for path in safetensors_files(folder)
    ]
    where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118

    def read(source: str) -> torch.Tensor:
        return where[source].get_tensor(source)

    biases = [(n, b) for n, b in model.named_buffers() if n.endswith("feed_forward.expert_bias")]
    loaded = 0
    for name, param in [*model.named_parameters(), *biases]:
        if name.startswith("mtp."):
            continue  # the imported formats have no MTP modules: they keep their initialization
        # A pipeline's last stage holds its own copy of a tied head: the embedding's rows.
        if name == "output.weight" and cfg.tie_embeddings:
            full = read(hf_name("tok_embeddings.weight"))
        else:
            full = from_hf(name, read, cfg, interleaved)
        full = _fit_rows(full, param.shape).to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            # Every rank read the same full tensor: slice locally, no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
        loaded += 1
    return loaded
