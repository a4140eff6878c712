"""Launch to first step, by phase: `pretrain` (one CPU rank) until its first optimizer step,
against a plain script that imports torch, builds the same model and runs one step on the
same corpus (bench/trainer_table.py's plain loop); and the same with `--nproc` ranks, forked
from the agent (the CPU default) and started as fresh interpreters (PRETRAIN_FORK_RANKS=0).

By default the workload of bench/trainer_table.py (d=256, 4 layers, vocab 8192, seq 256,
micro-batch 8, 2 threads for the one-rank run, 1 per rank for the others); key=value
overrides replace it (`--recipe-only` runs the recipe as shipped). Both clocks start at this
script's spawn of the process: the trainer logs its phases itself
(`trainer/observe/startup.py`, stamped from PRETRAIN_LAUNCH_T0): launcher (compose,
validate, plan, run dir), spawn (until the rank's process starts), imports, process group,
mesh, data open, model build, loaders and checkpoint, metrics and kernels, first step. Runs
alternate between the two, after one untimed warm-up of each (so the prepared dataset,
tokenizer and CPU peak are cached); medians over the rounds.

    python bench/launch_breakdown.py [--rounds 3] [--nproc 4] [--recipe-only] [key=value ...]
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

from trainer_table import ROOT, WORKLOAD, plain_run, plain_spec  # this folder, run as a script

PHASE = re.compile(r"([a-z ]+) ([0-9.]+) s")


def trainer_run(
    work: Path, index: str, overrides: list[str], nproc: int = 1, fork: bool = True
) -> dict[str, float]:
    """The phases of one `pretrain` launch that stops after its first step (rank 0's), with
    `nproc` ranks forked from the agent or, with `fork` off, started as fresh interpreters."""
    threads = 2 if nproc == 1 else 1  # two cores
    cmd = [sys.executable, "-m", "pretrain", "--config-name", "tiny", "train.steps=1"]
    cmd += ["logging.wandb=disabled", f"cluster.gpus_per_node={nproc}", "eval.every=0"]
    cmd += [f"cluster.omp_num_threads={threads}", *overrides, f"run.dir={work / index}"]
    if nproc > 1:
        cmd.append(f"train.global_batch={batch_per_rank(overrides) * nproc}")
    # This checkout's code, whichever one the package is installed from.
    env = dict(os.environ, PYTHONPATH=str(ROOT), PRETRAIN_FORK_RANKS="1" if fork else "0")
    env["PRETRAIN_LAUNCH_T0"] = str(time.time())
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=work, check=False, env=env)
    line = next((x for x in result.stdout.splitlines() if "startup:" in x), None)
    if result.returncode or line is None:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    phases, total = line.split("startup: ", 1)[1].split("; ")
    out = {name.strip(): float(s) for name, s in PHASE.findall(phases)}
    out["total"] = float(total.split(" s")[0])
    return out


def batch_per_rank(overrides: list[str]) -> int:
    """The one-rank run's global batch (the tiny recipe's 16 unless overridden)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("train.global_batch=")]
    return int(given[-1]) if given else 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--nproc", type=int, default=4, help="ranks of the multi-rank launches (forked vs fresh)"
    )
    parser.add_argument("--recipe-only", action="store_true", help="the tiny recipe as shipped")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = args.overrides or ([] if args.recipe_only else list(WORKLOAD))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trainer_run(work, "warm-up", overrides)
        spec = plain_spec(work / "warm-up" / "config.yaml", steps=1)
        plain_run(spec, threads=2)
        runs, forked, fresh, plains = [], [], [], []
        for i in range(args.rounds):
            runs.append(trainer_run(work, f"one-{i}", overrides))
            plains.append(plain_run(spec, threads=2)["first_step_s"])
            if args.nproc > 1:
                forked.append(trainer_run(work, f"forked-{i}", overrides, args.nproc))
                fresh.append(trainer_run(work, f"fresh-{i}", overrides, args.nproc, fork=False))
    print(
        f"launch to first step, {args.rounds} rounds, medians (seconds), load average "
        f"{os.getloadavg()[0]:.1f} at the end:"
    )
    print(
        f"  {'phase':24s} {'1 rank':>8s} {f'{args.nproc} forked':>10s} {f'{args.nproc} fresh':>10s}"
    )
    names = list(dict.fromkeys(n for r in runs + forked + fresh for n in r))
    for name in names:
        cells = [
            statistics.median(r.get(name, 0.0) for r in rs) if rs else float("nan")
            for rs in (runs, forked, fresh)
        ]
        print(f"  {name:24s} {cells[0]:8.2f} {cells[1]:10.2f} {cells[2]:10.2f}")
    plain = statistics.median(plains)
    print(f"  {'plain script (total)':24s} {plain:8.2f}")
    one = statistics.median(r["total"] for r in runs)
    print(f"  one rank - plain script: {one - plain:+.2f} s")


if __name__ == "__main__":
    main()
