"""`pretrain-export RUN_DIR [--step N] OUT_DIR`: a checkpoint as a Hugging Face Llama directory.

Writes `model.safetensors`, `config.json` (LlamaForCausalLM), `generation_config.json` and
the tokenizer (`tokenizer.json` + `tokenizer_config.json`). Our rotary embedding uses the
half-split layout that Hugging Face's Llama uses, so the attention weights are copied
unpermuted. Runs in one process without a process group (DCP reads any layout's shards,
pipeline stages included; vocabulary rows padded for tensor parallelism are dropped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import models
from pretrain_core.rundir import CHECKPOINTS_DIR, CONFIG_FILE
from pretrain_core.schema import RecipeConfig, load_config
from trainer.checkpoint import find_checkpoint
from trainer.tokenizer import eos_id, load_tokenizer
from trainer.vocab_resize import load_resizing_vocab

# Our parameter names (after "layers.{i}.") -> Hugging Face Llama's (after "model.layers.{i}.").
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of one of our parameters."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_BLOCK_NAMES[rest]}"


def load_model(run_dir: Path, step: int | None = None) -> tuple[nn.Module, RecipeConfig, int]:
    """The plain model with the weights of a run's newest checkpoint (or that of `step`),
    the run's config and the step."""
    cfg = load_config(str(Path(run_dir) / CONFIG_FILE))
    path = find_checkpoint(Path(run_dir) / CHECKPOINTS_DIR, step)
    if path is None:
        which = f"of step {step} " if step is not None else ""
        raise FileNotFoundError(
            f"no complete checkpoint {which}in {Path(run_dir) / CHECKPOINTS_DIR}"
        )
    model = models.build(cfg.model).to_empty(device="cpu")
    model.init_buffers("cpu")
    state = model.state_dict()
    # A checkpoint saved under TP may hold vocabulary rows padded to a multiple of tp: cut.
    load_resizing_vocab({"model": state}, path, no_dist=not dist.is_initialized())
    model.load_state_dict(state)
    return model.eval(), cfg, int(path.name.split("_")[1])


def hf_config(cfg: RecipeConfig, eos: int) -> dict:
    """config.json of the equivalent LlamaForCausalLM."""
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def refuse_unexportable(cfg: RecipeConfig) -> None:
    """Raise ValueError for a model this exporter cannot write as a Hugging Face Llama."""
    if cfg.model.is_mla:
        raise ValueError(
            "model.attention=mla: multi-head latent attention is DeepSeek-V2's, not Llama's; "
            "writing DeepSeek-V2's format (its MoE layout and rotary permutation) is not "
            "implemented, so this run's checkpoints can be resumed but not exported"
        )


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write the Hugging Face directory for a run's checkpoint; returns `out_dir`."""
    refuse_unexportable(load_config(str(Path(run_dir) / CONFIG_FILE)))
    model, cfg, _ = load_model(run_dir, step)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and cfg.model.tie_embeddings:
            continue  # Hugging Face ties lm_head to embed_tokens itself
        tensors[hf_name(name)] = tensor.contiguous()
    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size)
    eos = eos_id(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, eos), indent=2) + "\n")
    generation = {"bos_token_id": eos, "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_token = tokenizer.id_to_token(eos)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": eos_token,
        "model_max_length": cfg.model.max_seq_len,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-export`."""
    parser = argparse.ArgumentParser(
        prog="pretrain-export",
        description="Write a run's checkpoint as a Hugging Face Llama directory.",
    )
    parser.add_argument("run_dir", type=Path, help="the run dir (holds config.yaml, checkpoints/)")
    parser.add_argument("out_dir", type=Path, help="where to write the Hugging Face directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out_dir, args.step)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"pretrain-export: {err}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
