"""The flat metric names the trainer logs (metrics.jsonl, the console) and their keys in
W&B and TensorBoard: one table, read by the trainer's sinks and by `pretrain-report`, which
draws the W&B dashboard's panels from metrics.jsonl."""

from __future__ import annotations

WANDB_KEYS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "hfu": "perf/hfu",
    "peak_tflops": "perf/peak_tflops",
    "peak_dtype": "perf/peak_dtype",
    "peak_source": "perf/peak_source",
    "loss_scale": "train/loss_scale",
    "skipped_steps": "train/skipped_steps",
    "step_time_s": "perf/step_time_s",
    "data_wait_s": "time/data_wait_s",
    "mem_peak_gib": "mem/peak_gib",
    "moe_tokens_per_expert_min": "moe/tokens_per_expert_min",
    "moe_tokens_per_expert_max": "moe/tokens_per_expert_max",
    "moe_tokens_per_expert_mean": "moe/tokens_per_expert_mean",
    "moe_dropped_frac": "moe/dropped_frac",
    "moe_aux_loss": "moe/aux_loss",
    "moe_z_loss": "moe/z_loss",
    "val_loss": "val/loss",
    "val_ppl": "val/ppl",
    "goodput": "goodput/goodput",
}
"""Flat metric name -> W&B key; names not listed go under their prefix's section
(WANDB_PREFIXES) or train/."""
WANDB_PREFIXES = {"tokens_seen_": "data/", "val_loss_": "val/"}
"""Flat metric name prefix -> W&B section (tokens_seen_fineweb -> data/tokens_seen_fineweb,
a source's validation loss val_loss_fineweb -> val/val_loss_fineweb)."""
SECTION_PREFIXES = {"goodput_": "goodput/", "timeout_": "timeout/", "compile_": "compile/"}
"""Flat metric name prefix -> W&B section, the prefix dropped (goodput_productive_s ->
goodput/productive_s: core/run/goodput.py; timeout_step_s -> timeout/step_s, the limits
in force: trainer/faults/timeouts.py; compile_graphs -> compile/graphs:
trainer/observe/compile_watch.py)."""


OWN_KEY_SECTIONS = ("eval", "stability")
"""Sections whose flat names are their own W&B keys: eval/<task>/acc (`trainer/evals/`) and
stability/<monitor>[/<layer>] (`trainer/observe/stability.py`)."""


def wandb_key(name: str) -> str:
    """The W&B key of a flat metric name."""
    if name in WANDB_KEYS:
        return WANDB_KEYS[name]
    if name.startswith("time_"):
        return "time/" + name.removeprefix("time_")
    for prefix, section in WANDB_PREFIXES.items():
        if name.startswith(prefix):
            return section + name
    for prefix, section in SECTION_PREFIXES.items():
        if name.startswith(prefix):
            return section + name.removeprefix(prefix)
    return name if "/" in name else f"train/{name}"


def flat_name(key: str) -> str:
    """The flat metric name of a W&B key (the inverse of wandb_key for every listed name)."""
    for name, wandb in WANDB_KEYS.items():
        if wandb == key:
            return name
    section, _, rest = key.partition("/")
    if section in OWN_KEY_SECTIONS:
        return key
    if section == "time":
        return "time_" + rest
    for prefix, dropped in SECTION_PREFIXES.items():
        if key.startswith(dropped):
            return prefix + rest
    return rest
