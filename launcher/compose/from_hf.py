"""`init.from_hf=DIR` adopts the checkpoint's model and tokenizer into the composed recipe.

Every `model.*` field config.json states (shape, norm epsilon, RoPE base and scaling, tied
embeddings, ...) that the user left alone is taken from it; "left alone" means neither given
on the command line nor changed from the schema's default by a recipe. A field the user set to
another value is refused, naming both. The folder's tokenizer is used when `data.tokenizer`
is the default (`train`) and not given on the command line, and a tokenizer other than the
folder's is refused, since its ids would index the checkpoint's embedding rows wrongly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pretrain.core.hf.llama import model_fields, same_scaling, same_value
from pretrain.core.inputs.reading import ReadError, mapping, read_json
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import Problem, RecipeError
from pretrain.core.schema import RecipeConfig

TOKENIZER_FILE = "tokenizer.json"


def _given(overrides: list[str]) -> set[str]:
    """The dotted fields the command line sets (`+model.rope_scaling.factor` names
    model.rope_scaling)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return keys | {".".join(k.split(".")[:2]) for k in keys if k.startswith("model.")}


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(theirs, dict):
        return same_scaling(theirs, dict(ours))
    return same_value(theirs, ours)


def _shown(value: Any) -> str:
    return (json.dumps(value) if value else "{}") if isinstance(value, dict) else repr(value)


def _tokens_of(path: Path) -> Any:
    """What makes two tokenizer.json files the same tokenizer: the model (vocabulary, merges)
    and the added tokens."""
    # A tokenizer.json holds its whole vocabulary and merges: tens of MB for large ones.
    content = mapping(read_json(path, "a tokenizer.json", 1 << 30), path, "a tokenizer.json")
    return content.get("model"), content.get("added_tokens")


def _adopt_tokenizer(cfg: RecipeConfig, folder: Path, given: set[str]) -> list[Problem | str]:
    ours = folder / TOKENIZER_FILE
    if not ours.is_file() or cfg.data.tokenizer == "none":
        return []  # no tokenizer to adopt, or pre-tokenized data (ids the user vouches for)
    if cfg.data.tokenizer == "train":
        if "data.tokenizer" in given:
            return [
                Problem(
                    "data.tokenizer",
                    "train",
                    f"a newly trained tokenizer's ids do not index the embedding of "
                    f"init.from_hf={folder}, which comes with its own tokenizer",
                    f"leave data.tokenizer unset, or set data.tokenizer={folder}",
                )
            ]
        cfg.data.tokenizer = str(folder)
        return [f"data.tokenizer={folder} (the checkpoint's tokenizer)"]
    path = Path(os.path.expanduser(cfg.data.tokenizer))
    theirs = path / TOKENIZER_FILE if path.is_dir() else path
    if theirs.is_file() and _tokens_of(theirs) != _tokens_of(ours):
        return [
            Problem(
                "data.tokenizer",
                cfg.data.tokenizer,
                f"is another tokenizer than the one of init.from_hf={folder} ({ours}): its ids "
                "would index the checkpoint's embedding rows wrongly",
                f"set data.tokenizer={folder}, or leave it unset to use the checkpoint's",
            )
        ]
    return []


def adopt_hf_model(cfg: RecipeConfig, overrides: list[str]) -> list[str]:
    """Take `cfg.model`'s fields and tokenizer from `cfg.init.from_hf`'s folder (in place) as
    the module says; the adopted fields as `field=value` lines. Raises RecipeError naming
    each field the user set to another value than the checkpoint's. Nothing happens when the
    folder or its config.json is missing (validation reports that)."""
    if not cfg.init.from_hf:
        return []
    folder = Path(os.path.expanduser(cfg.init.from_hf))
    try:
        hf = read_json(folder / "config.json", "a Hugging Face model's config.json")
    except ReadError:
        return []  # validation names what is wrong with the folder
    if not isinstance(hf, dict):
        return []
    given = _given(overrides)
    defaults = ModelConfig()
    adopted: list[str] = []
    problems: list[Problem] = []
    for name, theirs in model_fields(hf).items():
        # n_kv_heads=0 means n_heads: compare the count of key/value heads, not the spelling.
        ours = cfg.model.kv_heads if name == "n_kv_heads" else getattr(cfg.model, name)
        if _same(theirs, ours) or (name, theirs, ours) == ("moe_balance", "bias", "both"):
            continue  # `both` balances by the bias too (and trains on the loss)
        field = f"model.{name}"
        # head_dim reads back as the width: whether a recipe set it is its raw value.
        changed = (
            cfg.model.explicit_head_dim != 0
            if name == "head_dim"
            else not _same(getattr(defaults, name), getattr(cfg.model, name))
        )
        if field in given or changed:
            problems.append(
                Problem(
                    field,
                    ours,
                    f"init.from_hf={folder} has {_shown(theirs)} (config.json)",
                    f"leave {field} unset to take the checkpoint's, or set it to {_shown(theirs)}",
                )
            )
            continue
        setattr(cfg.model, name, dict(theirs) if isinstance(theirs, dict) else theirs)
        adopted.append(f"{field}={_shown(theirs)}")
    for found in _adopt_tokenizer(cfg, folder, given):
        if isinstance(found, Problem):
            problems.append(found)
        else:
            adopted.append(found)
    if problems:
        raise RecipeError(problems)
    return adopted


def adopted_lines(cfg: RecipeConfig, overrides: list[str]) -> list[str]:
    """`adopt_hf_model`'s result as the lines the console shows."""
    adopted = adopt_hf_model(cfg, overrides)
    if not adopted:
        return []
    return [f"from {cfg.init.from_hf}/config.json:", *(f"  {line}" for line in adopted)]
