"""`pretrain-export RUN_DIR OUT_DIR [--step N] [--overwrite]`: a checkpoint as a Hugging
Face directory.

Writes `model.safetensors`, `config.json`, `generation_config.json` and the tokenizer
(`tokenizer.json` + `tokenizer_config.json`). A dense model is a LlamaForCausalLM; a
mixture-of-experts model is a MixtralForCausalLM in Mixtral's own file layout (each layer's
router as `block_sparse_moe.gate`, each stacked expert as `block_sparse_moe.experts.{j}.w1/w2/
w3`), which Mixtral can hold only when every layer is MoE with a softmax router over
renormalized top-k weights, no shared experts and no balancing bias; any other MoE model is
refused, before anything is written, with what stands in the way. Mixtral routes without
dropping tokens, as a model trained with a capacity factor does at inference.

Before a byte is read, the checkpoint is checked against its manifest (sizes and SHA-256), and
a target directory that holds files is refused unless `--overwrite` is given, which removes
the weights, indexes, configs and tokenizer files a loader would read (so no stale
`model.safetensors.index.json` wins over the new weights); other files are left alone.

Our rotary embedding uses the half-split layout that Hugging Face's Llama uses, so the
attention weights are copied unpermuted. Runs in one process without a process group (DCP
reads any layout's shards, pipeline stages included; vocabulary rows padded for tensor
parallelism are dropped).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from pretrain import models
from pretrain.core.hf_llama import config_json, hf_name
from pretrain.core.model_config import ModelConfig
from pretrain.core.run.rundir import CHECKPOINTS_DIR, CONFIG_FILE
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.dataprep.tokenizer import eos_id, load_tokenizer
from pretrain.trainer.checkpoint.checkpointer import DCP_METADATA, META, find_checkpoint
from pretrain.trainer.checkpoint.integrity import checksum_problems, size_problems
from pretrain.trainer.checkpoint.vocab_resize import load_resizing_vocab

_EXPERT_WEIGHTS = ("w1", "w2", "w3")
"""Stacked [experts, ...] weights under feed_forward.experts; Mixtral names them alike."""


class ExportError(ValueError):
    """The run's model has no Hugging Face equivalent; the message says what stands in the way."""


def hf_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of our parameters under its Hugging Face name(s): a stacked expert weight becomes
    one tensor per expert."""
    _, index, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
    stacked, _, weight = rest.rpartition(".")
    if stacked == "feed_forward.experts" and weight in _EXPERT_WEIGHTS:
        prefix = f"model.layers.{index}.block_sparse_moe.experts"
        return {f"{prefix}.{j}.{weight}.weight": t.contiguous() for j, t in enumerate(tensor)}
    return {hf_name(name): tensor.contiguous()}


def mixtral_problems(m: ModelConfig) -> list[str]:
    """Why this MoE model cannot be written as Mixtral (empty when it can)."""
    problems = []
    if m.moe_shared_experts:
        problems.append(
            f"model.moe_shared_experts={m.moe_shared_experts}: Mixtral has no shared experts "
            "(always-on experts beside the routed ones), and no Llama-family format transformers "
            "loads has them without a gate of its own; export a model trained without them"
        )
    if m.n_moe_layers != m.n_layers:
        problems.append(
            f"model.moe_layers={m.moe_layers}: {m.n_layers - m.n_moe_layers} of {m.n_layers} "
            "layers are dense, and every Mixtral layer is MoE; export a model with "
            "model.moe_layers=all"
        )
    if m.balance_bias:
        problems.append(
            f"model.moe_balance={m.moe_balance}: the per-expert balancing bias decides which "
            "experts a token runs through, and Mixtral's router has no such bias; export a model "
            "trained with model.moe_balance=aux"
        )
    if m.moe_node_limit:
        problems.append(
            f"model.moe_node_limit={m.moe_node_limit}: each token's experts come from its best "
            "node groups only, and Mixtral's router takes the top-k of all experts; export a "
            "model trained with model.moe_node_limit=0"
        )
    if m.moe_router != "softmax" or not m.moe_normalize_topk:
        problems.append(
            f"model.moe_router={m.moe_router} with model.moe_normalize_topk="
            f"{m.moe_normalize_topk}: Mixtral weights the top-k experts by their softmax scores "
            "renormalized to sum to 1 (softmax, true)"
        )
    return problems


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
    problems, names = size_problems(path, META, DCP_METADATA)
    problems = problems or checksum_problems(path, names)
    if problems:
        raise ExportError(
            f"checkpoint {path} does not match its manifest: " + "; ".join(problems) + "; "
            "restore a good copy, or export another step with --step"
        )
    model = models.build(cfg.model).to_empty(device="cpu")
    model.init_buffers("cpu")
    state = model.state_dict()
    # A checkpoint saved under TP may hold vocabulary rows padded to a multiple of tp: cut.
    load_resizing_vocab({"model": state}, path, no_dist=not dist.is_initialized())
    model.load_state_dict(state)
    return model.eval(), cfg, int(path.name.split("_")[1])


def hf_config(cfg: RecipeConfig, eos: int | None) -> dict:
    """config.json of the equivalent LlamaForCausalLM or MixtralForCausalLM."""
    m = cfg.model
    config = config_json(m, eos)
    if not m.moe_experts:
        return config
    del config["mlp_bias"]
    return {
        **config,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": m.expert_ffn_dim,
        "num_local_experts": m.moe_experts,
        "num_experts_per_tok": m.moe_top_k,
        "router_aux_loss_coef": m.moe_aux_loss_coef,
        "sliding_window": None,
    }


def refuse_unexportable(cfg: RecipeConfig) -> None:
    """Raise ExportError for an attention or MLP this exporter cannot write in a Hugging Face
    format."""
    if cfg.model.mlp != "swiglu":
        raise ExportError(
            f"model.mlp={cfg.model.mlp}: Llama's and Mixtral's MLPs are SwiGLU (gate, up and "
            "down projections), so a one-input MLP has no place there; this run's checkpoints "
            "can be resumed but not exported"
        )
    if cfg.model.qk_norm and cfg.model.attn_bias:
        raise ExportError(
            "model.qk_norm=true with model.attn_bias=true: Qwen3 (the family with query/key "
            "norms) puts a bias on the output projection too when it has biases, and Qwen2 "
            "has no norms; export a model trained with one of the two"
        )
    if cfg.model.sliding_window and (cfg.model.qk_norm or cfg.model.attn_bias):
        raise ExportError(
            f"model.sliding_window={cfg.model.sliding_window} with Qwen's attention options: "
            "Mistral (the family with one window on every layer) has neither biases nor "
            "query/key norms; export a model trained without one or the other"
        )
    if cfg.model.is_mla:
        raise ExportError(
            "model.attention=mla: multi-head latent attention is DeepSeek-V2's, not Llama's; "
            "writing DeepSeek-V2's format (its MoE layout and rotary permutation) is not "
            "implemented, so this run's checkpoints can be resumed but not exported"
        )


HF_FILES = (
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip
"""What a Hugging Face loader reads from a directory: `--overwrite` removes these first."""


def clear_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse (ExportError) a target directory that holds files, unless `overwrite`: then
    remove the files a Hugging Face loader would read there."""
    if not out_dir.exists():
        existing = next(p for p in out_dir.parents if p.exists())  # the root always exists
        if not existing.is_dir():
            raise ExportError(
                f"{out_dir}: {existing} is a file, so no directory can be made under it; give "
                "the path of a new or empty directory"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ExportError(f"{out_dir}: {existing} cannot be written by this user; give "
                              "a directory you can write")  # fmt: skip
        return
    if not out_dir.is_dir():
        raise ExportError(
            f"{out_dir} exists and is a file, not a directory; give the path of a new or "
            "empty directory (a Hugging Face model is a directory of files)"
        )
    held = sorted(p.name for p in out_dir.iterdir())
    if not held:
        return
    if not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ExportError(
            f"{out_dir} is not empty (holds {shown}); files left there could be loaded in place "
            "of the new ones: give an empty or new directory, or --overwrite to replace them"
        )
    for pattern in HF_FILES:
        for stale in out_dir.glob(pattern):
            if stale.is_file() or stale.is_symlink():
                stale.unlink()


def readable_by_all(path: Path) -> None:
    """Give a file the permissions a plain `open` would (0666 less the umask): safetensors
    writes its files 0600, which other users of a shared model folder cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def export(run_dir: Path, out_dir: Path, step: int | None = None, overwrite: bool = False) -> Path:
    """Write the Hugging Face directory for a run's checkpoint; returns `out_dir`. Raises
    ExportError, before reading the checkpoint, for a model no Hugging Face format holds, a
    checkpoint that fails its manifest, or a non-empty `out_dir` without `overwrite`."""
    cfg = load_config(str(Path(run_dir) / CONFIG_FILE))
    refuse_unexportable(cfg)
    problems = mixtral_problems(cfg.model) if cfg.model.moe_experts else []
    if problems:
        raise ExportError(
            f"{cfg.name} cannot be exported as a Hugging Face MixtralForCausalLM:\n"
            + "\n".join(problems)
        )
    out_dir = Path(out_dir)
    clear_target(out_dir, overwrite)
    model, cfg, _ = load_model(run_dir, step)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and cfg.model.tie_embeddings:
            continue  # Hugging Face ties lm_head to embed_tokens itself
        if name.startswith("mtp."):
            continue  # no place in the Llama/Mixtral format: said below
        tensors.update(hf_tensors(name, tensor))
    if cfg.model.mtp_layers:
        print(
            f"dropped the {cfg.model.mtp_layers} multi-token prediction module(s) "
            "(model.mtp_layers): the Hugging Face Llama and Mixtral formats have no place "
            "for them; the exported model predicts the next token only"
        )
    tokenizer = (
        None if cfg.data.tokenizer == "none" else load_tokenizer(cfg.data, cfg.model.vocab_size)
    )
    eos = eos_id(tokenizer) if tokenizer is not None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    readable_by_all(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, eos), indent=2) + "\n")
    generation = {"bos_token_id": eos, "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is None:
        return out_dir  # pre-tokenized data: there is no tokenizer to ship
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
        description="Write a run's checkpoint as a Hugging Face Llama (or Mixtral) directory.",
    )
    parser.add_argument("run_dir", type=Path, help="the run dir (holds config.yaml, checkpoints/)")
    parser.add_argument("out_dir", type=Path, help="where to write the Hugging Face directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT_DIR, removing the weights, configs and tokenizer there",
    )
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out_dir, args.step, args.overwrite)
    except FileNotFoundError as err:  # no run dir, config or checkpoint: the user's to fix
        raise ExportError(str(err)) from None
    print(f"wrote {out}")


def entry() -> None:
    """Console entry point of `pretrain-export`: `main` inside the error boundary (a user
    error exits 2, Ctrl-C 130, a bug 1 with its traceback saved, never shown)."""
    from pretrain.core.inputs.boundary import run_command

    run_command("pretrain-export", main, (ExportError,))


if __name__ == "__main__":
    entry()
