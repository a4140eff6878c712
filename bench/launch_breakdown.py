"""Launch to first step, by phase: `pretrain` on the tiny recipe (one CPU rank) until its
first optimizer step, against a plain script that imports torch, builds the same model and
runs one step; and the same with `--nproc` ranks, forked from the agent (the CPU default)
and started as fresh interpreters (PRETRAIN_FORK_RANKS=0).

The trainer logs the phases itself (`trainer/observe/startup.py`): launcher (compose, validate,
plan, run dir), torchrun (the agent until the rank's process starts), imports, process
group, mesh, data open, model build, loaders and checkpoint, metrics and kernels, first
step. Runs alternate between the two, after one untimed warm-up of each (so the prepared
dataset and tokenizer are cached); medians over the rounds.

    python bench/launch_breakdown.py [--rounds 3] [--nproc 4]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIN = """
import time, torch, torch.nn.functional as F
from pretrain.models import build
from pretrain.models.init import init_weights
from pretrain.core.model_config import ModelConfig
cfg = ModelConfig(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                  max_seq_len=512)
model = build(cfg)
init_weights(model, 0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
tokens = torch.randint(0, 4096, (16, 129))
for mb in tokens.split(4):
    loss = F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
    (loss / 4).backward()
opt.step()
"""
PHASE = re.compile(r"([a-z ]+) ([0-9.]+) s")


def trainer_run(work: Path, index: str, nproc: int = 1, fork: bool = True) -> dict[str, float]:
    """The phases of one `pretrain` launch that stops after its first step (rank 0's), with
    `nproc` ranks forked from the agent or, with `fork` off, started as fresh interpreters."""
    cmd = [sys.executable, "-m", "pretrain", "--config-name", "tiny", "train.steps=1"]
    cmd += ["logging.wandb=disabled", f"cluster.gpus_per_node={nproc}"]
    cmd += [f"train.global_batch={16 * nproc}", f"run.dir={work / index}"]
    env = dict(os.environ, PRETRAIN_FORK_RANKS="1" if fork else "0")
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=work, check=False, env=env)
    line = next((x for x in result.stdout.splitlines() if "startup:" in x), None)
    if result.returncode or line is None:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    phases, total = line.split("startup: ", 1)[1].split("; ")
    out = {name.strip(): float(s) for name, s in PHASE.findall(phases)}
    out["total"] = float(total.split(" s")[0])
    return out


def plain_run() -> float:
    """Seconds from starting a plain script's interpreter to the end of its first step."""
    start = time.time()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", PLAIN], check=True, env=env)
    return time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--nproc", type=int, default=4, help="ranks of the multi-rank launches (forked vs fresh)"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trainer_run(work, "warm-up")
        plain_run()
        runs, forked, fresh, plains = [], [], [], []
        for i in range(args.rounds):
            runs.append(trainer_run(work, f"one-{i}"))
            plains.append(plain_run())
            forked.append(trainer_run(work, f"forked-{i}", args.nproc, fork=True))
            fresh.append(trainer_run(work, f"fresh-{i}", args.nproc, fork=False))
    print(f"launch to first step, {args.rounds} rounds, medians (seconds):")
    print(
        f"  {'phase':24s} {'1 rank':>8s} {f'{args.nproc} forked':>10s} {f'{args.nproc} fresh':>10s}"
    )
    names = list(dict.fromkeys(n for r in runs + forked + fresh for n in r))
    for name in names:
        cells = [statistics.median(r.get(name, 0.0) for r in rs) for rs in (runs, forked, fresh)]
        print(f"  {name:24s} {cells[0]:8.2f} {cells[1]:10.2f} {cells[2]:10.2f}")
    print(f"  {'plain script (total)':24s} {statistics.median(plains):8.2f}")


if __name__ == "__main__":
    main()
