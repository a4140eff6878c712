"""init.from_hf: Hugging Face checkpoints of each family the trainer builds (one exported by
us, the others written by transformers itself from small random configs) load under tensor
and pipeline parallelism and compute the logits transformers computes from the same folder.
All families share one TP2 launch and one PP2 launch (tests/distributed/hf_logits.py), their
recipes composed in this process. The MoE and DeepSeek families also train 3 steps from
their folder and export to one transformers reloads with the trained logits, and the tiny_moe
reference run exports as a Qwen2-MoE. Two of the training runs write Hugging Face folders as
they go (checkpoint.hf_every, from tp shards and from ep and ZeRO-3 shards), bit for bit
what `pretrain export` writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pretrain.trainer.checkpoint.export import export, load_model
from tests.distributed.harness import BASE_OVERRIDES, launch, read_curve, run_pretrain
from tests.distributed.hf_logits import TOKENS, loss_of
from tests.helpers import pretrain_in_process

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
        config = getattr(transformers, f"{prefix}Config")(**{**HARNESS_SHAPE, **extra})
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "norm.weight")):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.1)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's balancing bias
                    buffer.normal_(0.0, 0.1)
        model.save_pretrained(folder)

    return write


llama_3_2 = written_by_transformers(
    "Llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)  # fmt: skip
"""A Llama 3.2-format checkpoint: tied embeddings, RoPE base 500000, llama3 scaling."""


EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
MLA = {
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 4, "rms_norm_eps": 1e-6,
}  # fmt: skip
DEEPSEEK = ("model.n_kv_heads=4",)
"""Latent attention decompresses a key and a value per query head."""
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip
"""DeepSeek-V2-Lite's YaRN (its mscale_all_dim scales the softmax), on shorter positions."""

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
    "qwen2_moe (gated shared experts, dense first layer)": (
        written_by_transformers(
            "Qwen2Moe", **EXPERTS, num_experts=4, shared_expert_intermediate_size=64,
            mlp_only_layers=[0],
        ),
        transformers.Qwen2MoeForCausalLM, (),
    ),
    "qwen3_moe (qk norms, every second layer MoE)": (
        written_by_transformers(
            "Qwen3Moe", **EXPERTS, num_experts=4, decoder_sparse_step=2, norm_topk_prob=True,
        ),
        transformers.Qwen3MoeForCausalLM, (),
    ),
    "deepseek_v2 (MLA, yarn mscale, 2 shared experts)": (
        written_by_transformers(
            "DeepseekV2", **EXPERTS, **MLA, q_lora_rank=None, n_shared_experts=2,
            rope_scaling=dict(YARN),
        ),
        transformers.DeepseekV2ForCausalLM, DEEPSEEK,
    ),
    "deepseek_v3 (sigmoid router, 1 of 2 groups, bias)": (
        written_by_transformers(
            "DeepseekV3", **EXPERTS, **MLA, q_lora_rank=24, n_shared_experts=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        ),
        transformers.DeepseekV3ForCausalLM, DEEPSEEK,
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
        # The CLI's own main, in this process: a subprocess per family costs seconds.
        code, _, err = pretrain_in_process(
            *BASE_OVERRIDES, *layout, *FAMILIES[name][2], "cluster.gpus_per_node=2",
            f"init.from_hf={folder}", "action=script", f"run.dir={run_dir}", cwd=workdir,
        )  # fmt: skip
        assert code == 0, err
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
        # Qwen3's per-head norms and DeepSeek's replicated latent norms have gradients to compare.
        assert layout != ("parallel.tp=2",) or bool(grads) == name.startswith(("qwen3", "deep"))
        for hf_param, grad in grads.items():
            torch.testing.assert_close(grad, hf_grads[hf_param].grad, rtol=1e-4, atol=1e-7)


def test_a_llama_3_2_checkpoint_with_rope_scaling_trains_under_tp2_and_exports(
    workdir: Path, folders: dict[str, Path]
) -> None:
    folder = folders["llama 3.2 (rope_scaling llama3)"]
    overrides = [
        "parallel.tp=2", f"init.from_hf={folder}", "train.steps=3", "eval.every=0",
        "checkpoint.every=3", "checkpoint.hf_every=1", "checkpoint.keep=2",
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
    # checkpoint.hf_every=1 wrote a folder after each step from the tp shards, kept the
    # newest 2 (checkpoint.keep) and left no unfinished one; the last is what export writes.
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_00000002", "step_00000003"]
    assert_same_folder(run_dir / "hf" / "step_00000003", exported)


def assert_same_folder(written: Path, exported: Path) -> None:
    """A folder the trainer wrote (checkpoint.hf_every, in shards with an index) holds the
    tensors of `pretrain export`'s, bit for bit, and the same config.json."""
    index = json.loads((written / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(index.values())):
        tensors |= load_file(written / file)
    expected = load_file(exported / "model.safetensors")
    assert tensors.keys() == expected.keys() == index.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    config = json.loads((written / "config.json").read_text())
    assert config == json.loads((exported / "config.json").read_text())


TRAINED = {
    "qwen3_moe": ((), 1),
    "deepseek_v2": ((), 1),
    "deepseek_v3": (("parallel.ep=2", "parallel.zero=3", "checkpoint.hf_every=3"), 2),
}
"""Family -> (its layout, ranks): DeepSeek-V3 with its experts over ep=2 and ZeRO-3 writes a
Hugging Face folder from those shards too (checkpoint.hf_every)."""


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_a_moe_family_trains_3_steps_from_its_folder_and_exports_with_the_trained_logits(
    workdir: Path, folders: dict[str, Path], name: str
) -> None:
    family = next(f for f in FAMILIES if f.startswith(name))
    hf_class, extra = FAMILIES[family][1:]
    layout, ranks = TRAINED[name]
    run_dir = workdir / f"{name}_trained"
    overrides = [
        *extra, *layout, f"init.from_hf={folders[family]}", "train.steps=3", "eval.every=0",
        "checkpoint.every=3",
    ]  # fmt: skip
    result = launch(run_dir, overrides, nproc=ranks)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = export(run_dir, workdir / f"{name}_exported")
    if "checkpoint.hf_every=3" in layout:
        assert_same_folder(run_dir / "hf" / "step_00000003", exported)
    ours, cfg, step = load_model(run_dir)
    assert step == 3
    if cfg.model.balance_bias:
        # DeepSeek-V3's e_score_correction_bias loaded, moved by the rate at each step towards
        # balance, and exported.
        before = load_file(folders[family] / "model.safetensors")
        after = load_file(exported / "model.safetensors")
        moved = [after[k] - before[k] for k in before if k.endswith("e_score_correction_bias")]
        steps = torch.cat(moved).abs() / cfg.model.moe_bias_rate
        assert moved and steps.max() > 0.5
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-3)
        assert steps.max() <= 3 + 1e-3
    hf = hf_class.from_pretrained(exported).eval()
    with torch.no_grad():
        expected, actual = ours(TOKENS), hf(TOKENS).logits
    print(f"{name} export after 3 steps: max |logits difference| "
          f"{(actual - expected).abs().max():.2e}")  # fmt: skip
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_the_tiny_moe_reference_run_exports_as_a_qwen2_moe_with_its_logits(
    workdir: Path, moe_reference_run: Path
) -> None:
    """tiny_moe's shared expert has no gate: Qwen2-MoE's gate is written zero and its down
    projection doubled, exactly."""
    exported = export(moe_reference_run, workdir / "tiny_moe_exported")
    ours, cfg, step = load_model(moe_reference_run)
    assert step == cfg.train.steps and cfg.model.moe_shared_experts == 1
    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(exported).eval()
    assert hf.config.mlp_only_layers == [0]
    with torch.no_grad():
        expected, actual = ours(TOKENS), hf(TOKENS).logits
    print(f"tiny_moe as Qwen2-MoE after {step} steps: max |logits difference| "
          f"{(actual - expected).abs().max():.2e}")  # fmt: skip
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
