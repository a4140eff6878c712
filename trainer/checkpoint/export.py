"""`pretrain-export RUN_DIR OUT_DIR [--step N] [--overwrite]`: a checkpoint as a Hugging
Face directory.

Writes `model.safetensors`, `config.json`, `generation_config.json` and the tokenizer
(`tokenizer.json` + `tokenizer_config.json`), in the format of the model's family
(core/hf/llama.py, core/hf/moe.py): Llama, Qwen2, Qwen3 or Mistral for a dense model;
Mixtral, Qwen2-MoE (shared experts; `tiny_moe`) or Qwen3-MoE (query/key norms) for a
grouped-query MoE model; DeepSeek-V2 (softmax router; `deepseek_v2_lite`) or DeepSeek-V3
(sigmoid router, balancing bias as e_score_correction_bias, group-limited routing as
n_group/topk_group) for latent attention. Each stacked expert weight becomes one tensor per
expert. A model its family cannot hold is refused, before anything is written, with what
stands in the way. The exported model routes without dropping tokens, as a model trained
with a capacity factor does at inference.

Before a byte is read, the checkpoint is checked against its manifest (sizes and SHA-256), and
a target directory that holds files is refused unless `--overwrite` is given, which removes
the weights, indexes, configs and tokenizer files a loader would read (so no stale
`model.safetensors.index.json` wins over the new weights); other files are left alone.

Our rotary embedding uses the half-split layout that Hugging Face's Llama uses, so the
attention weights are copied unpermuted, except DeepSeek's interleaved rotary rows
(trainer/checkpoint/hf_tensors.py). Runs in one process without a process group (DCP
reads any layout's shards, pipeline stages included; vocabulary rows padded for tensor
parallelism are dropped).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from pretrain import models
from pretrain.core.hf.export import export_refusal
from pretrain.core.hf.llama import config_json
from pretrain.core.layout import expert_node_groups
from pretrain.core.run.rundir import CHECKPOINTS_DIR, CONFIG_FILE
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.dataprep.tokenizer import eos_id, load_tokenizer
from pretrain.models.moe import set_node_groups
from pretrain.trainer.checkpoint.checkpointer import DCP_METADATA, META, find_checkpoint
from pretrain.trainer.checkpoint.hf_tensors import to_hf
from pretrain.trainer.checkpoint.integrity import checksum_problems, size_problems
from pretrain.trainer.checkpoint.vocab_resize import load_resizing_vocab


class ExportError(ValueError):
    """The run's model has no Hugging Face equivalent; the message says what stands in the way."""


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
    set_node_groups(model, expert_node_groups(cfg))  # the groups the run routed over
    state = model.state_dict()
    # A checkpoint saved under TP may hold vocabulary rows padded to a multiple of tp: cut.
    load_resizing_vocab({"model": state}, path, no_dist=not dist.is_initialized())
    model.load_state_dict(state)
    return model.eval(), cfg, int(path.name.split("_")[1])


def hf_config(cfg: RecipeConfig, eos: int | None) -> dict:
    """config.json of the equivalent model of the run's family."""
    return config_json(cfg.model, eos, expert_node_groups(cfg))


def refuse_unexportable(cfg: RecipeConfig) -> None:
    """Raise ExportError for a model no Hugging Face family this exporter writes holds,
    naming what stands in the way."""
    refusal = export_refusal(cfg.model, expert_node_groups(cfg))
    if refusal is not None:
        raise ExportError(f"{cfg.name} {refusal}")


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
    out_dir = Path(out_dir)
    clear_target(out_dir, overwrite)
    model, cfg, _ = load_model(run_dir, step)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and cfg.model.tie_embeddings:
            continue  # Hugging Face ties lm_head to embed_tokens itself
        if name.startswith("mtp."):
            continue  # no place in the exported formats: said below
        tensors.update(to_hf(name, tensor, cfg.model))
    if cfg.model.mtp_layers:
        print(
            f"dropped the {cfg.model.mtp_layers} multi-token prediction module(s) "
            "(model.mtp_layers): the exported Hugging Face formats have no place for "
            "them; the exported model predicts the next token only"
        )
    tokenizer = run_tokenizer(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    readable_by_all(out_dir / "model.safetensors")
    write_hf_config(out_dir, cfg, tokenizer)
    return out_dir


def run_tokenizer(cfg: RecipeConfig) -> Tokenizer | None:
    """The run's tokenizer; None for pre-tokenized data."""
    if cfg.data.tokenizer == "none":
        return None
    return load_tokenizer(cfg.data, cfg.model.vocab_size)


def write_hf_config(out_dir: Path, cfg: RecipeConfig, tokenizer: Tokenizer | None) -> None:
    """Beside a Hugging Face folder's weights: config.json, generation_config.json and the
    tokenizer (tokenizer.json, tokenizer_config.json) when the run has one."""
    eos = eos_id(tokenizer) if tokenizer is not None else None
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, eos), indent=2) + "\n")
    generation = {"bos_token_id": eos, "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is None:
        return  # pre-tokenized data: there is no tokenizer to ship
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_token = tokenizer.id_to_token(eos)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": eos_token,
        "model_max_length": cfg.model.max_seq_len,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-export`."""
    parser = argparse.ArgumentParser(
        prog="pretrain-export",
        description="Write a run's checkpoint as a Hugging Face directory of its family.",
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
