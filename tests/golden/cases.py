"""The golden cases and how one is run: 20 FP32 steps of a shipped recipe, logged every step,
on a corpus kept in the repository (`CORPUS`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tests.distributed.harness import Curve, run_pretrain

GOLDEN_DIR = Path(__file__).resolve().parent
CORPUS = GOLDEN_DIR / "corpus.jsonl.xz"
"""The text the golden runs train on, and their tokenizer is trained on: 300 source files of
CPython 3.11.7's standard library (the first, in path order, of at most 16 KB each; 1.9 MB
as JSONL, 250 KB as xz), one document each. The recipes' own `data.source=stdlib` reads
whatever Python runs the tests, and its files change between patch releases; this file does
not (`python -m tests.golden.regenerate --corpus` rewrites it from the Python that runs it).
The first 200 such files (1 MB) were tried first: on them step 20's gradient norm of tiny
differed by 3.3% between its two layouts, which no CPU-independent bound could hold."""
STEPS = 20
COMMON = (
    f"train.steps={STEPS}",
    "logging.log_every=1",
    "logging.wandb=disabled",
    "checkpoint.every=0",
)
LOSS_TOLERANCE = 1e-4
"""Per-step |fresh - golden| / |golden| of the loss. A rerun on the machine that wrote the
files is bit-identical. Other CPUs pick other BLAS kernels, i.e. other orders of FP32 sums;
the same run under two layouts (another order of every reduction) differs by at most 4e-7
in loss over these 20 steps (2.5e-7 for tiny, 3.7e-7 for tiny_moe, measured on the
committed files), so 1e-4 holds across CPU types and still catches a change of model, data
order, init or optimizer (> 1e-3 at once)."""
GRAD_NORM_TOLERANCE = 1e-3
"""The same for the gradient norm, a sum of squares over every parameter that amplifies
reordering: two layouts of one run differ by up to 5.0e-5 (tiny; 2.8e-5 for tiny_moe, on
the committed files)."""


@dataclass(frozen=True)
class GoldenCase:
    """One committed curve: a recipe, a rank count and the layout overrides."""

    name: str
    recipe: str
    nproc: int
    overrides: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.json"


CASES = (
    GoldenCase("tiny_1rank", "tiny", 1),
    GoldenCase(
        "tiny_4rank_tp2_sp_zero2",
        "tiny",
        4,
        ("parallel.tp=2", "parallel.sp=true", "parallel.zero=2"),
    ),
    GoldenCase("tiny_moe_1rank", "tiny_moe", 1),
    GoldenCase(
        "tiny_moe_4rank_pp2_ep2_zero2",
        "tiny_moe",
        4,
        ("parallel.pp=2", "parallel.ep=2", "parallel.zero=2"),
    ),
)


def corpus_identity() -> str:
    """What the golden curves depend on besides the code: the digest of `CORPUS`."""
    return f"corpus sha256 {hashlib.sha256(CORPUS.read_bytes()).hexdigest()}"


def run_case(case: GoldenCase, run_dir: Path) -> Curve:
    """Train `case` through the CLI, with the shipped recipe's own model, batch and data
    settings, on `CORPUS`."""
    cmd_overrides = [f"data.source={CORPUS}", *COMMON, *case.overrides]
    return run_pretrain(run_dir, cmd_overrides, nproc=case.nproc, recipe=case.recipe, base=())


def write_golden(case: GoldenCase, curve: Curve) -> None:
    """Commit-ready JSON of one curve, with what it was made from."""
    data = {
        "recipe": case.recipe,
        "nproc": case.nproc,
        "overrides": [*COMMON, *case.overrides],
        "made_with": corpus_identity(),
        "loss": curve.loss,
        "grad_norm": curve.grad_norm,
        "val_loss": curve.val_loss,
    }
    case.path.write_text(json.dumps(data, indent=1) + "\n")


def read_golden(case: GoldenCase) -> tuple[Curve, str]:
    """The committed curve of `case` and the corpus identity it was made with."""
    data = json.loads(case.path.read_text())
    curve = Curve(loss=data["loss"], grad_norm=data["grad_norm"], val_loss=data.get("val_loss", []))
    return curve, data["made_with"]


__all__ = [
    "CASES",
    "CORPUS",
    "GRAD_NORM_TOLERANCE",
    "LOSS_TOLERANCE",
    "GoldenCase",
    "read_golden",
    "run_case",
]
