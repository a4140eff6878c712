"""GPU check: what one H100/H200 delivers for a ~1B Llama in BF16 and FP8, in a few minutes.

    python bench/gpu/check.py              # on a GPU machine (about 5 minutes on an H100)
    python bench/gpu/check.py --dry-run    # on CPU: checks this script's logic, no GPU figures

Reports torch, CUDA, Transformer Engine and torchao availability, then trains the llama3_1b
shape on one GPU (random tokens, short sequences) in BF16 and in FP8 with every installed
backend, selective recompute off and on, and prints tokens/s, TFLOP/s, MFU (against the peak of
the dtype the matmuls run in), the FP8/BF16 throughput ratio and the peak memory beside the
plan's estimate. A missing package is reported with what to install, and skipped.

--dry-run runs the same code on the tiny model on CPU with FP8 emulated: throughput is the
CPU's, and the GPU-only columns (MFU, device memory) print n/a rather than invented figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pretrain.core.hardware import match_device_name  # noqa: E402
from pretrain.core.layout import resolve_degrees  # noqa: E402
from pretrain.core.precision import BACKEND_INSTALL, peak_dtype  # noqa: E402
from pretrain.core.schema import HardwareConfig, RecipeConfig, to_recipe  # noqa: E402
from pretrain.launcher.plan.plan import make_plan  # noqa: E402
from pretrain.launcher.validate.recipe import validate  # noqa: E402
from pretrain.models.flops import flops_per_token  # noqa: E402
from pretrain.parallel.mesh import build_mesh  # noqa: E402
from pretrain.trainer.build import build_train_state  # noqa: E402
from pretrain.trainer.dist import init_distributed  # noqa: E402
from pretrain.trainer.kernels import optimizer_path, sdpa_backend  # noqa: E402
from pretrain.trainer.observe.metrics import resolve_peak_flops  # noqa: E402
from pretrain.trainer.step.context import StepContext  # noqa: E402
from pretrain.trainer.step.local import train_step  # noqa: E402

PRECISIONS = {"bf16": ("bf16", None), "fp8-torchao": ("fp8", "torchao"), "fp8-te": ("fp8", "te")}
RECOMPUTE = ("none", "selective", "full")
COMPILE = ("off", "on")
BUDGET_S = 450.0
"""Wall-clock budget of the measurements: configurations not started by then are skipped,
so the check ends within 8 minutes on one H100/H200 whatever compiles cost."""
MODULES = {"torchao": "torchao", "te": "transformer_engine.pytorch"}


@dataclass
class Row:
    """One configuration's figures; None where not measured (skipped, or not on a GPU)."""

    precision: str
    recompute: str
    compile: str = "off"
    status: str = "ok"
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_source: str = ""
    mem_gib: float | None = None
    plan_mem_gib: float | None = None
    plan_error: float | None = None
    """(plan - measured) / measured peak memory; the target is within +-10%."""
    sdpa: str = ""
    """The SDPA backend the attention dispatched to (flash, memory-efficient, math...)."""
    optimizer: str = ""
    """fused, foreach or for-loop: the optimizer step's implementation."""


def availability() -> dict[str, str]:
    """Versions of torch, CUDA, the GPU, Transformer Engine and torchao, or why they are missing."""
    found = {"torch": torch.__version__}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        found["cuda"] = f"{torch.version.cuda}, {name} (compute capability {major}.{minor})"
    else:
        found["cuda"] = "not available"
    for backend, module in MODULES.items():
        try:
            found[backend] = getattr(importlib.import_module(module), "__version__", "installed")
        except Exception as error:  # TE fails with OSError when its CUDA libraries are missing
            found[backend] = (
                f"missing ({type(error).__name__}: {error}); {BACKEND_INSTALL[backend]}"
            )
    return found


def recipe(
    dry_run: bool, precision: str, recompute: str, args: argparse.Namespace, compiled: str = "off"
) -> RecipeConfig:
    """The llama3_1b shape on one GPU (the tiny model on CPU for --dry-run)."""
    dtype, backend = PRECISIONS[precision]
    model_file = "tiny.yaml" if dry_run else "llama3_1b.yaml"
    model = OmegaConf.load(ROOT / "recipes" / "model" / model_file)
    gpu = "cpu" if dry_run else match_device_name(torch.cuda.get_device_name()) or "h100_sxm"
    node = {
        "name": f"gpu_check_{precision}_{recompute}_compile_{compiled}",
        "compile": {"enabled": compiled == "on"},
        "model": model,
        "precision": {"dtype": dtype, "fp8_backend": backend or "torchao", "fp8_emulate": dry_run}
        if dtype == "fp8"
        else {"dtype": dtype},
        "recompute": {"policy": recompute},
        "train": {
            "steps": args.warmup + args.steps,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "global_batch": args.micro_batch,
        },
        "schedule": {"name": "constant", "warmup_steps": 0},
        "cluster": {"device": "cpu" if dry_run else "cuda", "gpu_type": gpu, "gpus_per_node": 1},
        "parallel": {"zero": 0},
    }
    return to_recipe(node)


def measure(cfg: RecipeConfig, rank, args: argparse.Namespace, dry_run: bool) -> Row:
    """Train `cfg` for warmup + timed steps on random tokens and read the figures."""
    row = Row(cfg.precision.dtype, cfg.recompute.policy, "on" if cfg.compile.enabled else "off")
    device = rank.device
    degrees = resolve_degrees(cfg)
    state = build_train_state(cfg, build_mesh(degrees, device.type), device)
    dtype = torch.bfloat16 if cfg.precision.dtype != "fp32" else torch.float32
    row.sdpa = sdpa_backend(cfg.model, cfg.train.seq_len, device, dtype)
    row.optimizer = optimizer_path(state.optimizer)
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    for _ in range(args.warmup):
        train_step(StepContext(state, cfg, degrees, device), batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(StepContext(state, cfg, degrees, device), batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    row.tokens_per_s = args.steps * args.micro_batch * args.seq_len / elapsed
    row.tflops = flops_per_token(cfg.model, cfg.train.seq_len).train * row.tokens_per_s / 1e12
    row.plan_mem_gib = make_plan(cfg).memory_gib
    if not dry_run:
        peak = resolve_peak_flops(device, peak_dtype(cfg.precision), HardwareConfig())
        row.peak_source = peak.source
        row.mfu = row.tflops / peak.tflops if peak.tflops else None
        row.mem_gib = torch.cuda.max_memory_allocated() / 2**30
        row.plan_error = (row.plan_mem_gib - row.mem_gib) / row.mem_gib
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table, with the FP8/BF16 throughput ratio (same recompute and
    compile) and the plan's error against the measured peak."""
    bf16 = {
        (r.recompute, r.compile): r.tokens_per_s
        for r in rows
        if r.precision == "bf16" and r.tokens_per_s
    }
    lines = [
        "| precision | recompute | compile | tokens/s | TFLOP/s | MFU | peak | FP8/BF16 "
        "| peak mem GiB | plan GiB | plan error | SDPA | optimizer | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        base = bf16.get((r.recompute, r.compile))
        ratio = r.tokens_per_s / base if r.tokens_per_s and base and r.precision != "bf16" else None
        mfu = None if r.mfu is None else 100 * r.mfu
        error = None if r.plan_error is None else 100 * r.plan_error
        lines.append(
            f"| {r.precision} | {r.recompute} | {r.compile} | {_fmt(r.tokens_per_s, ',.0f')} | "
            f"{_fmt(r.tflops, '.3g')} | {_fmt(mfu, '.1f')}{'%' if mfu else ''} | "
            f"{r.peak_source or 'n/a'} | {_fmt(ratio, '.2f')} | {_fmt(r.mem_gib, '.1f')} | "
            f"{_fmt(r.plan_mem_gib, '.3g')} | {_fmt(error, '+.1f')}{'%' if error else ''} | "
            f"{r.sdpa or 'n/a'} | {r.optimizer or 'n/a'} | {r.status} |"
        )
    return "\n".join(lines)


def configurations(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(precision, recompute, compile) in the order they run: every precision eager under
    each recompute policy, then each compiled where compile is asked for (most informative
    first, so a budget cut drops the least)."""
    chosen = [
        (precision, recompute, "off")
        for recompute in args.recompute or RECOMPUTE
        for precision in PRECISIONS
    ]
    if "on" in (args.compile or COMPILE):
        first = (args.recompute or RECOMPUTE)[0]
        chosen += [(precision, first, "on") for precision in PRECISIONS]
    if "off" not in (args.compile or COMPILE):
        chosen = [c for c in chosen if c[2] == "on"]
    return chosen


def run_one(
    found: dict[str, str], config: tuple[str, str, str], rank, args: argparse.Namespace
) -> Row:
    """Measure one configuration, or say why it was skipped or failed."""
    precision, recompute, compiled = config
    backend = PRECISIONS[precision][1]
    row = Row(PRECISIONS[precision][0] if backend is None else precision, recompute, compiled)
    if backend and found[backend].startswith("missing"):
        row.status = f"skipped: {backend} missing ({BACKEND_INSTALL[backend]})"
    elif backend == "te" and args.dry_run:
        row.status = "skipped: Transformer Engine needs a CUDA GPU"
    else:
        cfg = recipe(args.dry_run, precision, recompute, args, compiled)
        try:
            validate(cfg)
            measured = measure(cfg, rank, args, args.dry_run)
            measured.precision = row.precision
            row = measured
        except Exception as error:  # one failing configuration must not stop the rest
            row.status = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, FP8 emulated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--recompute", choices=RECOMPUTE, action="append", help="policies to run (default: all)"
    )
    parser.add_argument(
        "--compile", choices=COMPILE, action="append", help="compile off, on (default: both)"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting after")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --dry-run to check the logic on CPU")
        return 2
    found = availability()
    for name, value in found.items():
        print(f"{name}: {value}")
    rank = init_distributed(
        to_recipe({"cluster": {"device": "cpu" if args.dry_run else "cuda"}}).cluster
    )
    start = time.perf_counter()
    rows: list[Row] = []
    for config in configurations(args):
        if time.perf_counter() - start > args.budget_s:
            precision, recompute, compiled = config
            rows.append(Row(precision, recompute, compiled, status="skipped: time budget"))
        else:
            rows.append(run_one(found, config, rank, args))
        row = rows[-1]
        print(
            f"{row.precision} / {row.recompute} / compile {row.compile}: {row.status}", flush=True
        )
    print(("dry run on CPU: no GPU figures\n" if args.dry_run else "") + table(rows))
    if args.json:
        report = {
            "environment": found,
            "elapsed_s": time.perf_counter() - start,
            "rows": [r.__dict__ for r in rows],
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
