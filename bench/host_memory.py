"""Peak host memory (RSS) of a rank against a plain PyTorch loop: the same model, batch shape
and optimizer, each in a fresh process, for the same number of steps.

(a) `pretrain` trains the recipe on one CPU rank (its corpus, loader, metrics, checkpoint at
the end) and logs the rank's own peak RSS each step (`mem_peak_gib` in metrics.jsonl); (b) a
plain script reads the frozen config.yaml of that run, builds the same model and runs the
same number of AdamW steps on random tokens of the same shape, then prints its peak RSS.
Runs alternate, after one warm-up of each (the prepared dataset cached); medians.

    python bench/host_memory.py [--rounds 3] [--steps 20] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
PLAIN = """
import json, resource, sys, torch, torch.nn.functional as F
from pretrain.models import build
from pretrain.models.init import init_weights
from pretrain.core.schema import load_config
cfg = load_config(sys.argv[1])
steps = int(sys.argv[2])
model = build(cfg.model)
init_weights(model, cfg.seed)
opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, foreach=True)
accum = cfg.train.global_batch // cfg.train.micro_batch
for _ in range(steps):
    for _ in range(accum):
        mb = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1))
        loss = F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
        (loss / accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def trainer_rss(run_dir: Path, steps: int, overrides: list[str]) -> float:
    """GiB: the rank's peak RSS at the last step of a one-rank `pretrain` run."""
    cmd = [sys.executable, "-m", "pretrain", "--config-name", "tiny", f"train.steps={steps}"]
    cmd += ["logging.wandb=disabled", "cluster.gpus_per_node=1", f"run.dir={run_dir}"]
    result = subprocess.run([*cmd, *overrides], capture_output=True, text=True, check=False)
    if result.returncode:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(rows[-1])["mem_peak_gib"]


def plain_rss(config: Path, steps: int) -> float:
    """GiB: the peak RSS of the plain loop on the run's model and batch shape."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, str(config), str(steps)],
        capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])["rss"] / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trainer_rss(work / "warm-up", args.steps, args.overrides)
        config = work / "warm-up" / "config.yaml"
        plain_rss(config, args.steps)
        trainer, plain = [], []
        for i in range(args.rounds):
            trainer.append(trainer_rss(work / str(i), args.steps, args.overrides))
            plain.append(plain_rss(config, args.steps))
    t, p = statistics.median(trainer), statistics.median(plain)
    print(f"peak RSS over {args.steps} steps, medians of {args.rounds} rounds:")
    print(f"  plain loop   {p * 1024:8.1f} MiB")
    print(f"  trainer rank {t * 1024:8.1f} MiB  ({t / p:.3f} of the plain loop)")


if __name__ == "__main__":
    main()
