"""How fast `pretrain --help` and `pretrain action=plan` start, and that they skip torch.

Prints the median wall time of several runs of each command (as a user would type it)
next to `python -c pass` in the same run, so the figure reads as overhead over a bare
interpreter on this machine.

    python bench/cli_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "pretrain --help": [sys.executable, "-m", "pretrain", "--help"],
    "pretrain action=plan": [sys.executable, "-m", "pretrain", "action=plan"],
    "pretrain --config-name llama3_70b action=plan plan.format=json": [
        sys.executable,
        "-m",
        "pretrain",
        "--config-name",
        "llama3_70b",
        "action=plan",
        "plan.format=json",
    ],
}

TORCH_CHECK = (
    "import sys, runpy; sys.argv = ['pretrain', 'action=plan'];\n"
    "try:\n    runpy.run_module('pretrain', run_name='__main__')\n"
    "except SystemExit:\n    pass\n"
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported')"
)


def time_command(cmd: list[str], repeats: int) -> float:
    """Median wall seconds of `cmd` over `repeats` runs (output discarded)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for label, cmd in COMMANDS.items():
        print(f"{label:<70} {time_command(cmd, args.repeats):6.2f} s")
    check = subprocess.run(
        [sys.executable, "-c", TORCH_CHECK], capture_output=True, text=True, check=True
    )
    print(f"action=plan: {check.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
