"""init.from_hf: a checkpoint exported to Hugging Face format loads back into a tensor-parallel
run, which computes the same logits as transformers does from the exported directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import BASE_OVERRIDES, run_pretrain
from tests.distributed.hf_logits import TOKENS
from tests.helpers import pretrain
from trainer.checkpoint.export import export

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed


def test_an_exported_checkpoint_reloads_into_tp2_with_the_same_logits(workdir: Path) -> None:
    trained = workdir / "trained"
    run_pretrain(trained, ["train.steps=2", "checkpoint.every=2", "eval.every=0"], nproc=1)
    hf_dir = export(trained, workdir / "hf")
    imported = workdir / "imported"
    result = pretrain(
        *BASE_OVERRIDES, "parallel.tp=2", "cluster.gpus_per_node=2", f"init.from_hf={hf_dir}",
        "action=script", f"run.dir={imported}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = workdir / "logits.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "tests.distributed.hf_logits",
               str(imported / "config.yaml"), str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = hf(TOKENS).logits
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-5, atol=1e-5)
