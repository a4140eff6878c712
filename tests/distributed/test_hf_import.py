"""init.from_hf: Hugging Face checkpoints of each family the trainer builds (one exported by
us, the others written by transformers itself from small random configs) load under tensor
and pipeline parallelism and compute the logits transformers computes from the same folder.
All families share one TP2 launch and one PP2 launch (tests/distributed/hf_logits.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.trainer.checkpoint.export import export, load_model
from tests.distributed.harness import BASE_OVERRIDES, launch, read_curve, run_pretrain
from tests.distributed.hf_logits import TOKENS, loss_of
from tests.helpers import pretrain

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4,
}  # fmt: skip
"""Llama 3.1+'s RoPE scaling with an original length shorter than TOKENS, so that the
interpolated band shows in every position's logits."""


HARNESS_SHAPE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
}  # fmt: skip
"""The harness model's shape (tests/distributed/harness.py), as config.json states it."""


def written_by_transformers(prefix: str, **extra: Any) -> Callable[[Path], None]:
    """How transformers' `{prefix}ForCausalLM` of the harness shape (and `extra`) is saved;
    biases and norm weights drawn away from their 0 and 1 so that they count."""

    def write(folder: Path) -> None:
        torch.manual_seed(1)
        config = getattr(transformers, f"{prefix}Config")(**HARNESS_SHAPE, **extra)
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "norm.weight")):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.1)
        model.save_pretrained(folder)

    return write


llama_3_2 = written_by_transformers(
    "Llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)  # fmt: skip
"""A Llama 3.2-format checkpoint: tied embeddings, RoPE base 500000, llama3 scaling."""


FAMILIES: dict[str, tuple[Callable[[Path], None] | None, type, tuple[str, ...]]] = {
    "llama (ours, exported)": (None, transformers.LlamaForCausalLM, ()),
    "llama 3.2 (rope_scaling llama3)": (llama_3_2, transformers.LlamaForCausalLM, ()),
    "qwen2 (q/k/v biases)": (
        written_by_transformers("Qwen2", rope_theta=1e6), transformers.Qwen2ForCausalLM, ()
    ),
    "qwen3 (qk norms, head_dim 24)": (
        written_by_transformers("Qwen3", head_dim=24, tie_word_embeddings=True),
        transformers.Qwen3ForCausalLM, (),
    ),
    "mistral (sliding window 4 of 8 tokens)": (
        written_by_transformers("Mistral", sliding_window=4, rms_norm_eps=1e-5),
        transformers.MistralForCausalLM, (),
    ),
    "mixtral (4 experts, top-2)": (
        written_by_transformers("Mixtral", num_local_experts=4, num_experts_per_tok=2),
        transformers.MixtralForCausalLM, (),
    ),
}  # fmt: skip
"""Family -> (how transformers writes its checkpoint, or None for one exported from a run of
ours; transformers' class; overrides our recipe needs for it besides the model.* fields
init.from_hf adopts from config.json)."""


@pytest.fixture(scope="module")
def folders(workdir: Path) -> dict[str, Path]:
    """Each family's Hugging Face folder."""
    made = {}
    for name, (make, _, _) in FAMILIES.items():
        folder = workdir / name.split(" ")[0].replace(".", "_") / str(len(made))
        if make is None:
            trained = workdir / "trained"
            overrides = ["train.steps=2", "checkpoint.every=2", "eval.every=0"]
            run_pretrain(trained, overrides, nproc=1)
            export(trained, folder)
        else:
            make(folder)
        made[name] = folder
    return made


def hf_logits(workdir: Path, folders: dict[str, Path], layout: tuple[str, ...]) -> list:
    """Each family's logits of TOKENS under `layout`, from one torchrun launch."""
    configs = []
    for i, (name, folder) in enumerate(folders.items()):
        run_dir = workdir / f"{'_'.join(layout)}_{i}".replace("=", "").replace(".", "")
        result = pretrain(
            *BASE_OVERRIDES, *layout, *FAMILIES[name][2], "cluster.gpus_per_node=2",
            f"init.from_hf={folder}", "action=script", f"run.dir={run_dir}", cwd=workdir,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        configs.append(str(run_dir / "config.yaml"))
    out = workdir / "logits.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "tests.distributed.hf_logits", str(out),
               *configs]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.pp=2",)], ids=["tp2", "pp2"])
def test_each_family_loads_under_the_layout_with_transformers_logits(
    workdir: Path, folders: dict[str, Path], layout: tuple[str, ...]
) -> None:
    found = hf_logits(workdir, folders, layout)
    for (name, folder), (logits, grads) in zip(folders.items(), found, strict=True):
        hf = FAMILIES[name][1].from_pretrained(folder).eval()
        expected = hf(TOKENS).logits
        print(f"{name} {layout[0]}: max |logits difference| {(logits - expected).abs().max():.2e}")
        torch.testing.assert_close(logits, expected.detach(), rtol=1e-5, atol=1e-5)
        # Per-head norm weights each TP rank applies to its own heads: summed over tp.
        loss_of(expected, expected.shape[-1]).backward()
        hf_grads = dict(hf.named_parameters())
        assert layout != ("parallel.tp=2",) or bool(grads) == ("qwen3" in name)
        for hf_param, grad in grads.items():
            torch.testing.assert_close(grad, hf_grads[hf_param].grad, rtol=1e-4, atol=1e-7)


def test_a_llama_3_2_checkpoint_with_rope_scaling_trains_under_tp2_and_exports(
    workdir: Path, folders: dict[str, Path]
) -> None:
    folder = folders["llama 3.2 (rope_scaling llama3)"]
    overrides = [
        "parallel.tp=2", f"init.from_hf={folder}", "train.steps=3", "eval.every=0",
        "checkpoint.every=3",
    ]  # fmt: skip
    run_dir = workdir / "llama_3_2_tp2"
    result = launch(run_dir, overrides, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    # Adopted from config.json, listed; then the weights are loaded on the ranks.
    assert '  model.rope_scaling={"rope_type": "llama3"' in output
    assert "  model.rope_theta=500000.0" in output and "  model.tie_embeddings=True" in output
    assert f"weights from {folder} (init.from_hf)" in output
    curve = read_curve(run_dir / "metrics.jsonl")
    assert len(curve.loss) == 3 and all(math.isfinite(loss) for loss in curve.loss)
    # After 3 steps under tp=2, the export reloads in transformers with our logits.
    exported = export(run_dir, workdir / "llama_3_2_exported")
    ours, _, step = load_model(run_dir)
    assert step == 3
    hf = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        expected, actual = ours(TOKENS), hf(TOKENS).logits
    print(f"llama 3.2 export after 3 steps: max |logits difference| "
          f"{(actual - expected).abs().max():.2e}")  # fmt: skip
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
