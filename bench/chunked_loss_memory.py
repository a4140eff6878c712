"""Peak memory of a training step with the LM head and loss whole or in sequence chunks.

Llama 3's vocabulary (128,256) at seq 2048 on the tiny depth (4 layers, d=128), FP32, one
CPU process, micro-batch 1: the logits dominate the step. For each `train.loss_chunks` the
step is measured by `pretrain.trainer.observe.memcheck` (every tensor's storage at the second
step's peak,
MemTracker) in a fresh process, which also reports its peak RSS; the planner's prediction
(launcher/plan/memory.py) is printed beside it.

Run: python bench/chunked_loss_memory.py [CHUNKS ...]   (default 1 4 16; about a minute each)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrain.core.layout import resolve_degrees
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.plan.memory import memory_breakdown

MIB = 2**20
CHILD = """
import json, resource, sys
from pretrain.trainer.observe.memcheck import main
main(sys.argv[1], sys.argv[2])
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def recipe(chunks: int) -> RecipeConfig:
    """The benchmark's recipe with `chunks` loss chunks."""
    cfg = RecipeConfig(name="chunked_loss_memory")
    m = cfg.model
    m.vocab_size, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.n_layers = 128256, 128, 4, 2, 384, 4
    m.max_seq_len = 2048
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 2048, 1, 1
    cfg.train.loss_chunks = chunks
    cfg.cluster.device, cfg.cluster.gpu_type, cfg.cluster.gpus_per_node = "cpu", "cpu", 1
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(chunks: int, work: Path) -> tuple[dict, int]:
    """(memcheck's figures, the process's peak RSS in bytes) of one step with `chunks`."""
    config, out = work / f"config_{chunks}.yaml", work / f"memory_{chunks}.json"
    config.write_text(dump_config(recipe(chunks)))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-c", CHILD, str(config), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    rss = json.loads(result.stdout.strip().splitlines()[-1])["rss"]
    return json.loads(out.read_text())[0], rss


def main(chunk_counts: list[int]) -> None:
    print("| loss_chunks | measured peak | vs whole | predicted peak (logits term) | peak RSS |")
    print("| --- | --- | --- | --- | --- |")
    whole = None
    with tempfile.TemporaryDirectory() as tmp:
        for chunks in chunk_counts:
            figures, rss = measure(chunks, Path(tmp))
            cfg = recipe(chunks)
            plan = memory_breakdown(cfg, resolve_degrees(cfg), 1)
            total = figures["total"]
            whole = whole or total
            predicted = f"{plan.total / MIB:,.0f} MiB ({plan.logits / MIB:,.0f} MiB)"
            print(
                f"| {chunks} | {total / MIB:,.0f} MiB | {total / whole:.2f} | {predicted} | "
                f"{rss / MIB:,.0f} MiB |",
                flush=True,
            )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4, 16])
