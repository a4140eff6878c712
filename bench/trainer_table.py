"""The trainer against a plain PyTorch loop, each run as a user runs it: tokens/s and peak RSS
as ratios to the plain loop, launch to the first step, compile time; eager and compiled.

Rows, each its own fresh process on one CPU rank: (plain) a script that imports torch,
builds the same model (`pretrain.models`), reads the same prepared corpus and trains with
AdamW (foreach) and gradient clipping, as a hand-written loop does; (eager) `pretrain` on the
recipe; (compiled) the same with `compile.enabled=true`. Every row runs the same steps with
the same threads. The rows alternate in rotating order over the rounds, after one untimed
warm-up of each (the corpus prepared, the inductor cache warm); ratios are taken within a
round and their medians reported, beside the machine's load average over the row's runs.

tokens/s: the median step time of steps 3 to the end (the first two include start-up and
compilation); launch to step 1: from this script's spawn of the process to the end of its
first step (the trainer's own startup line, stamped from the spawn); peak RSS: the
process's (the rank's) ru_maxrss.

    python bench/trainer_table.py [--rounds 3] [--steps 30] [--threads 2] [key=value ...]

Without overrides it runs the issue's workload: d=256, 4 layers, 4 heads, ffn 768, vocab
8192, seq 256, micro-batch 8 (= the global batch), FP32, on the tiny recipe's corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = (
    "model.dim=256",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.ffn_dim=768",
    "model.vocab_size=8192",
    "train.seq_len=256",
    "train.micro_batch=8",
    "train.global_batch=8",
)
PLAIN = """
import json, resource, sys, time
t_start = float(sys.argv[1])
import numpy as np, torch, torch.nn.functional as F
from pathlib import Path
from pretrain.core.model_config import ModelConfig
from pretrain.models import build
from pretrain.models.init import init_weights
spec = json.loads(sys.argv[2])
cfg = ModelConfig(**spec["model"])
model = build(cfg)
init_weights(model, spec["seed"])
decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n]
rest = [p for n, p in model.named_parameters() if p.ndim < 2 or "tok_embeddings" in n]
groups = [{"params": decay, "weight_decay": spec["weight_decay"]}, {"params": rest}]
opt = torch.optim.AdamW(
    groups, lr=spec["lr"], betas=spec["betas"], eps=spec["eps"], weight_decay=0.0, foreach=True
)
shards = sorted(Path(spec["dataset"]).glob("*.bin"))
tokens = np.concatenate([np.fromfile(s, dtype=np.uint16) for s in shards]).astype(np.int64)
tokens = torch.from_numpy(tokens)
g = torch.Generator().manual_seed(spec["seed"])
b, s, accum = spec["micro_batch"], spec["seq_len"], spec["accum"]
times, first = [], None
for step in range(spec["steps"]):
    begun = time.perf_counter()
    for _ in range(accum):
        starts = torch.randint(0, len(tokens) - s - 1, (b,), generator=g)
        batch = torch.stack([tokens[i : i + s + 1] for i in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        (loss / accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - begun)
    if first is None:
        first = time.time() - t_start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step_times": times, "first_step_s": first, "rss": rss}))
"""
STARTUP = re.compile(r"startup: .*; ([0-9.]+) s from launch to the first step")
GIB = 1024**3


@dataclass
class Row:
    """One row's measurements, one entry per round."""

    step_s: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    launch_s: list[float] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


def trainer_run(work: Path, name: str, args: argparse.Namespace, compiled: bool) -> dict:
    """One `pretrain` run of the workload: its per-step metrics, startup line and output."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "pretrain", "--config-name", args.recipe, *WORKLOAD]
    cmd += [f"train.steps={args.steps}", "cluster.gpus_per_node=1", "logging.wandb=disabled"]
    cmd += [f"cluster.omp_num_threads={args.threads}", "logging.log_every=1", "eval.every=0"]
    cmd += [f"compile.enabled={str(compiled).lower()}", f"run.dir={run_dir}", *args.overrides]
    # This checkout's code, whichever one the package is installed from.
    env = dict(os.environ, PYTHONPATH=str(ROOT), PRETRAIN_LAUNCH_T0=str(time.time()))
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, check=False)
    out = result.stdout + result.stderr
    found = STARTUP.search(out)
    if result.returncode or found is None:
        sys.exit(out[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "launch_s": float(found.group(1)), "output": out}


def plain_run(spec: dict, threads: int) -> dict:
    """The plain loop in a fresh interpreter: its step times, first step and peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    start = str(time.time())
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, start, json.dumps(spec)],
        capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def plain_spec(config: Path, steps: int) -> dict:
    """What the plain loop trains: the run's model, optimizer settings, batch shape and
    prepared corpus."""
    from pretrain.core.schema import load_config
    from pretrain.trainer.data.loader import dataset_places

    cfg = load_config(str(config))
    dataset = str(dataset_places(cfg.data, cfg.model.vocab_size)[0].folder)
    model = {
        k: v for k, v in vars(cfg.model).items() if not k.startswith("_") and k != "raw_head_dim"
    }
    return {
        "model": model,
        "seed": cfg.seed,
        "lr": cfg.optim.lr,
        "betas": list(cfg.optim.betas),
        "eps": cfg.optim.eps,
        "weight_decay": cfg.optim.weight_decay,
        "grad_clip": cfg.optim.grad_clip,
        "micro_batch": cfg.train.micro_batch,
        "seq_len": cfg.train.seq_len,
        "accum": cfg.train.global_batch // cfg.train.micro_batch,
        "steps": steps,
        "dataset": dataset,
    }


def steady(step_times: list[float]) -> float:
    """The median step time after the first two steps."""
    return statistics.median(step_times[2:])


def measure(rows: dict[str, Row], key: str, run: dict, step_s: float, rss: float) -> None:
    row = rows[key]
    row.step_s.append(step_s)
    row.rss.append(rss)
    row.launch_s.append(run["launch_s"])
    row.compile_s.append(run.get("compile_s", 0.0))


def one_round(
    rows: dict[str, Row], order: list[str], work: Path, index: int, spec: dict, args
) -> None:
    for key in order:
        load_before = os.getloadavg()[0]
        if key == "plain":
            result = plain_run(spec, args.threads)
            run = {"launch_s": result["first_step_s"]}
            measure(rows, key, run, steady(result["step_times"]), result["rss"])
        else:
            run = trainer_run(work, f"{key}-{index}", args, compiled=key == "compiled")
            last = run["rows"][-1]
            run["compile_s"] = last.get("compile_time_s", 0.0)
            step_times = [r["step_time_s"] for r in run["rows"]]
            measure(rows, key, run, steady(step_times), last["mem_peak_gib"] * GIB)
        rows[key].load += [load_before, os.getloadavg()[0]]


def report(rows: dict[str, Row], args: argparse.Namespace) -> None:
    import torch

    plain = rows["plain"]
    print(
        f"{args.rounds} rounds of {args.steps} steps, {args.threads} threads, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs; ratios within a round, medians"
    )
    print(
        "| trainer | ms/step | tok/s vs plain | peak RSS | peak RSS vs plain | "
        "launch to step 1 | compile | load average |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    labels = {"plain": "plain loop", "eager": "ours, eager", "compiled": "ours, compiled"}
    for key, label in labels.items():
        row = rows[key]
        speed = statistics.median(p / s for p, s in zip(plain.step_s, row.step_s, strict=True))
        memory = statistics.median(r / p for p, r in zip(plain.rss, row.rss, strict=True))
        compile_s = f"{statistics.median(row.compile_s):.1f} s" if key == "compiled" else "-"
        print(
            f"| {label} | {statistics.median(row.step_s) * 1e3:.1f} | {speed:.2f} | "
            f"{statistics.median(row.rss) / 2**20:.0f} MiB | {memory:.2f} | "
            f"{statistics.median(row.launch_s):.2f} s | {compile_s} | "
            f"{min(row.load):.1f}-{max(row.load):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = {key: Row() for key in ("plain", "eager", "compiled")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Warm-up: prepares the corpus, fills the inductor cache; its figures are dropped.
        trainer_run(work, "warm-up", args, compiled=True)
        trainer_run(work, "warm-up-eager", args, compiled=False)
        spec = plain_spec(work / "warm-up" / "config.yaml", args.steps)
        plain_run(spec, args.threads)
        order = list(rows)
        for index in range(args.rounds):
            shift = index % len(order)
            one_round(rows, order[shift:] + order[:shift], work, index, spec, args)
    report(rows, args)


if __name__ == "__main__":
    main()
