"""nanoGPT's own train/validation split: `train.bin` with a `val.bin` beside it.

nanoGPT's `prepare.py` scripts write both files into one folder. When `data.source` names a
`train.bin` whose folder holds a `val.bin`, and the recipe names no validation source, the
run validates on `val.bin` (`data.val_source`, with `data.val_fraction=0` unless the
command line asks for a held-out fraction instead), and the console says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.sources import resolve_format, single_source

TRAIN_FILE, VAL_FILE = "train.bin", "val.bin"


def nanogpt_val_lines(cfg: RecipeConfig, overrides: list[str]) -> list[str]:
    """Take `val.bin` beside a nanoGPT `train.bin` as `cfg.data.val_source` (in place), as
    the module says; the lines the console shows (none when nothing was taken)."""
    d = cfg.data
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if d.sources or d.val_source or "data.val_fraction" in given:
        return []
    path = Path(os.path.expanduser(d.source))
    val = path.with_name(VAL_FILE)
    if path.name != TRAIN_FILE or not val.is_file():
        return []
    if resolve_format(single_source(d, d.source)) != "nanogpt":
        return []
    d.val_source, d.val_fraction = str(val), 0.0
    return [
        f"data.val_source={val} (nanoGPT's {VAL_FILE} beside {TRAIN_FILE}; data.val_fraction=0)"
    ]
