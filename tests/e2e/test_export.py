"""`pretrain-export` writes a Hugging Face Llama (dense) or Mixtral (mixture-of-experts)
directory that transformers loads into a model giving the same logits as ours, with the
run's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.dataprep.tokenizer import load_tokenizer
from pretrain.trainer.checkpoint.export import load_model
from tests.distributed.harness import run_pretrain

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # the module's run dir trains first

TEXT = "def main() -> int:\n    return sum(range(10))\n"


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain.trainer.checkpoint.export", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank run with checkpoints at steps 2 and 4."""
    path = tmp_path_factory.mktemp("export") / "run"
    run_pretrain(path, ["train.steps=4", "checkpoint.every=2"], nproc=1)
    return path


# Mixtral's shape: every layer MoE, no shared experts (tiny_moe has both otherwise).
MIXTRAL_LIKE = [
    "--config-name", "tiny_moe", "model.moe_ffn_dim=64", "model.moe_shared_experts=0",
    "model.moe_layers=all",
]  # fmt: skip


@pytest.fixture(scope="module")
def moe_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank mixture-of-experts run with a checkpoint at step 2."""
    path = tmp_path_factory.mktemp("export_moe") / "run"
    overrides = ["train.steps=2", "checkpoint.every=2", *MIXTRAL_LIKE[2:]]
    run_pretrain(path, overrides, nproc=1, recipe="tiny_moe")
    return path


def assert_same_logits(hf_class: type, out: Path, run_dir: Path, step: int) -> None:
    """transformers' model from `out` and the run's checkpoint of `step` give the same logits
    on TEXT, tokenized alike by the exported tokenizer and ours."""
    ours, cfg, loaded = load_model(run_dir, step=step)
    assert loaded == step
    hf = hf_class.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tokenizer(TEXT)["input_ids"]
    assert ids == load_tokenizer(cfg.data, cfg.model.vocab_size).encode(TEXT).ids
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected, actual = ours(tokens), hf(tokens).logits
    print(f"{hf_class.__name__}: max |logits difference| {(actual - expected).abs().max():.2e}")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_exported_model_gives_our_logits_in_transformers(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = export_cli(run_dir, out, "--step", "2")
    assert result.returncode == 0, result.stderr
    assert_same_logits(transformers.LlamaForCausalLM, out, run_dir, step=2)


def test_exported_moe_model_is_a_mixtral_with_our_logits(moe_run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = export_cli(moe_run_dir, out)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"]) == (["MixtralForCausalLM"], 8)
    assert_same_logits(transformers.MixtralForCausalLM, out, moe_run_dir, step=2)


def test_the_newest_checkpoint_is_exported_by_default(run_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    assert export_cli(run_dir, tmp_path / "hf").returncode == 0
    newest, _, step = load_model(run_dir)
    assert step == 4
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], newest.output.weight)


def test_a_missing_step_is_a_clear_error(run_dir: Path, tmp_path: Path) -> None:
    result = export_cli(run_dir, tmp_path / "hf", "--step", "3")
    assert result.returncode != 0
    assert "no complete checkpoint of step 3 in" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_that_fails_its_manifest_is_refused_before_reading(
    run_dir: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = sorted((copy / "checkpoints").glob("step_*4/*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    result = export_cli(copy, tmp_path / "hf")
    assert result.returncode != 0
    assert f"{shard.name} does not match its checksum" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_target_is_refused_unless_overwrite_replaces_its_weights(
    run_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    stale_index = out / "model.safetensors.index.json"
    stale_index.write_text('{"weight_map": {"lm_head.weight": "old.safetensors"}}')
    (out / "notes.txt").write_text("mine")
    refused = export_cli(run_dir, out)
    assert refused.returncode != 0
    assert f"{out} is not empty" in refused.stderr and "--overwrite" in refused.stderr
    assert not (out / "model.safetensors").exists()

    assert export_cli(run_dir, out, "--overwrite").returncode == 0
    assert not stale_index.exists()
    assert (out / "notes.txt").read_text() == "mine"  # not a file a loader reads: kept
    assert_same_logits(transformers.LlamaForCausalLM, out, run_dir, step=4)


def test_exported_files_are_readable_by_others_as_the_umask_allows(
    run_dir: Path, tmp_path: Path
) -> None:
    import os

    assert export_cli(run_dir, tmp_path / "hf").returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    for path in (tmp_path / "hf").iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


@pytest.mark.parametrize(
    ("options", "hf_class"),
    [
        (["model.attn_bias=true"], "Qwen2ForCausalLM"),
        (
            ["model.qk_norm=true", "model.head_dim=24", "model.tie_embeddings=true"],
            "Qwen3ForCausalLM",
        ),
        (["model.sliding_window=8"], "MistralForCausalLM"),  # shorter than TEXT
    ],
    ids=["qwen2", "qwen3", "mistral"],
)
def test_a_qwen_or_mistral_shaped_model_exports_after_3_steps_with_our_logits(
    options: list[str], hf_class: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_pretrain(run_dir, ["train.steps=3", "checkpoint.every=3", "eval.every=0", *options], 1)
    out = tmp_path / "hf"
    result = export_cli(run_dir, out)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == [hf_class]
    # Not through AutoTokenizer: for a qwen2/qwen3 folder transformers 5 always builds its
    # Qwen2Tokenizer (its own pre-tokenizer) over the vocabulary, whatever tokenizer_config
    # says, so the run's own BPE is applied as the run applies it (alike for all three).
    ours, cfg, step = load_model(run_dir)
    assert step == 3
    hf = getattr(transformers, hf_class).from_pretrained(out).eval()
    tokens = torch.tensor([load_tokenizer(cfg.data, cfg.model.vocab_size).encode(TEXT).ids])
    with torch.no_grad():
        expected, actual = ours(tokens), hf(tokens).logits
    print(f"{hf_class}: max |logits difference| {(actual - expected).abs().max():.2e}")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
