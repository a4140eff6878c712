"""nanoGPT data as nanoGPT users have it: `val.bin` beside `train.bin` is the validation
split, a flat token file without end-of-sequence tokens is split by token range, and a
range too short for one validation sequence is refused before any job starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrain.core.problems import Checks
from pretrain.dataprep.checks import check_data_on_disk
from pretrain.dataprep.prepare import prepare_data
from pretrain.launcher.compose.nanogpt_split import nanogpt_val_lines
from pretrain.trainer.data.dataset import PreparedDataset, TokenStream
from tests.helpers import data_recipe


def token_file(path: Path, count: int, seed: int = 0) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(seed).integers(0, 500, count).astype(np.uint16)
    ids.tofile(path)
    return ids


def test_val_bin_beside_train_bin_becomes_the_validation_source(tmp_path: Path) -> None:
    train = tmp_path / "shakespeare" / "train.bin"
    token_file(train, 1000)
    token_file(train.with_name("val.bin"), 200, seed=1)
    cfg = data_recipe(str(train), tmp_path / "cache", "none", val_fraction=0.1)
    (line,) = nanogpt_val_lines(cfg, [])
    assert (cfg.data.val_source, cfg.data.val_fraction) == (str(train.with_name("val.bin")), 0)
    assert "nanoGPT's val.bin beside train.bin" in line
    # Asked for a held-out fraction on the command line: that is what the run gets.
    cfg = data_recipe(str(train), tmp_path / "cache", "none", val_fraction=0.1)
    assert nanogpt_val_lines(cfg, ["data.val_fraction=0.1"]) == [] and not cfg.data.val_source


def test_a_flat_token_file_is_split_by_token_range(tmp_path: Path) -> None:
    ids = token_file(tmp_path / "tokens.bin", 1000)
    cfg = data_recipe(str(tmp_path / "tokens.bin"), tmp_path / "cache", "none")
    [(place, _)] = prepare_data(cfg, report=lambda line: None, tty=False)
    dataset = PreparedDataset(place.folder)
    assert dataset.shards[0]["documents"] == 1  # no EOS: nothing to split by document
    train, val = dataset.split(0.05)
    assert (train, val) == ([(0, 0, 950)], [(0, 950, 1000)])
    held = TokenStream(dataset, val)
    assert held.read(0, len(held)).tolist() == ids[950:].tolist()


def test_a_token_range_too_short_for_one_sequence_is_refused_before_the_job(
    tmp_path: Path,
) -> None:
    token_file(tmp_path / "tokens.bin", 1000)
    cfg = data_recipe(str(tmp_path / "tokens.bin"), tmp_path / "cache", "none")
    cfg.data.val_fraction, cfg.eval.every = 0.005, 10  # 5 tokens, a sequence needs 9
    c = Checks()
    check_data_on_disk(c, cfg)
    (problem,) = [p for p in c.problems if p.field == "data.val_fraction"]
    assert "holds out the last 5 of the 1,000 tokens" in problem.reason
    assert "at least 0.009" in problem.fix
