"""The pairwise matrix: layouts of the harness model that together hold every pair of
features the validator accepts, each trained and compared with one process.

The features are the compatibility matrix's (`tests/compat_matrix.py`), set on a model of
the harness's shape (4 layers, 4 heads, 2 KV heads; `MODEL`), with data parallelism beside
the model-parallel degrees only where a case has a feature that needs it (a ZeRO stage,
expert parallelism: 2 ranks, 4 under HSDP). A case picks at most one feature of each group;
every accepted pair of features of different groups is in some case (a covering array, built
greedily by `generate`); each case keeps to 4 ranks (8 with HSDP or expert tensor
parallelism, which take 4 alone) and passes `validate(..., for_launch=True)` on CPU. CASES
is committed, so a change of the validator or of the features that leaves a pair uncovered
fails `tests/unit/test_pairwise_cover.py` until the cases are regenerated:
`python -m tests.pairwise_cases --write`.

Each case is compared with the one-process run of its numerics (`reference_of`): the same
precision, experts, attention, document masks, tied embeddings and optimizer, with the
layout's degrees, schedule, ZeRO stage, recompute, compilation and loss chunks left out.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pretrain.core.layout import resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate
from tests.compat_matrix import FEATURES, Feature, compatibility

HERE = Path(__file__)
MAX_RANKS = 4
MAX_RANKS_WIDE = 8
WIDE = {"hsdp", "etp"}
"""Features that take 4 ranks alone (HSDP: 2 replicas of 2 shards; etp: tp 2 and ep 2 over
2 data-parallel ranks), so that a pair with another parallel degree needs 8."""
MICRO_BATCHES = 2
"""Micro-batches of one sequence per data-parallel rank and step: gradient accumulation in
every case; the V schedules get V_MICRO_BATCHES."""
V_MICRO_BATCHES = 4
"""As many as DualPipeV needs at pp=2 (2pp)."""
RANK_TOKENS = 32
"""Tokens of a sequence each rank holds: a whole MXFP8 block of 32 under context
parallelism too."""
LIGHT_AT_8 = {"tp", "cp", "pp", "zero", "moe", "recompute"}
"""Kinds of features a case of 8 ranks takes: the pairs it is there for are of parallel
features, and every other pair of HSDP or expert tensor parallelism fits 4 ranks (an 8-rank
case with the numeric features too trains for up to a minute here)."""

NOT_ON_CPU: dict[frozenset[str], str] = {
    frozenset({"block fp8"}): "torchao's blockwise FP8 runs triton kernels and has no CPU "
    "emulation (validation refuses it with cluster.device=cpu)",
    frozenset({"fp8 experts"}): "torchao's rowwise FP8 grouped GEMM of the experts runs triton "
    "kernels and torch._scaled_grouped_mm (CUDA only); the experts' MXFP8 grouped GEMM "
    "emulates, and the mxfp8 feature runs it with every MoE feature",
}
"""Features, and pairs, the validator accepts for a GPU job that no CPU run can train: why."""

NUMERIC_GROUPS = ("dtype", "moe", "attention", "doc_mask", "tied", "optim")
"""Groups whose features change what is computed: a case's one-process reference has them.
The others (degrees, schedules, ZeRO stages, recompute, compilation, loss chunks) change only
where and in which order it is computed."""


def harness_fields(feature: Feature) -> tuple[tuple[str, Any], ...]:
    """The feature's fields on the harness model on CPU: MLA's query latent fits its width
    (32), FP8 is emulated, FP16's loss scale starts low, the GPU type is the machine's."""
    fields = []
    for path, value in feature.fields:
        if path == "cluster.gpu_type":
            continue
        if path == "model.mla_q_rank":
            value = 32
        fields.append((path, value))
    if dict(fields).get("precision.dtype") == "fp8":
        fields.append(("precision.fp8_emulate", True))
    if dict(fields).get("precision.dtype") == "fp16":
        # Far from float16's limit: at the default scale (2**16) a step near it overflows or
        # not by its gradients' last bits, which a layout and one process round apart (the
        # overflow itself is checked in tests/distributed/test_precision_parity.py).
        fields.append(("precision.loss_scale_init", 1024.0))
    return tuple(fields)


@functools.cache
def runnable() -> tuple[Feature, ...]:
    """The compatibility matrix's features a CPU run can train."""
    alone = {name for names in NOT_ON_CPU for name in names if len(names) == 1}
    return tuple(f for f in FEATURES if f.name not in alone)


def by_name() -> dict[str, Feature]:
    return {f.name: f for f in FEATURES}


MODEL = {
    "vocab_size": 512,
    "dim": 128,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 192,
    "n_layers": 4,
}
"""The harness model, twice as wide (dim 128): MXFP8's blocks of 32 then divide every shard
of tp=2 (the key/value width 64 / 2)."""
TRAIN = {"steps": 2, "micro_batch": 1}
"""Two steps: the first from the same weights everywhere, the second after an update made
of every rank's gradients (a reduction or an optimizer step gone wrong shows there)."""
BASE_OVERRIDES = (
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    *(f"train.{k}={v}" for k, v in TRAIN.items()),
    "data.max_bytes=400000",
    "data.val_fraction=0.1",
    "eval.every=2",
    "eval.batches=1",
    "schedule.warmup_steps=1",
    "optim.lr=3e-3",
    "logging.log_every=1",
    "logging.wandb=disabled",
    "compile.backend=aot_eager",
    "faults.collective_timeout_s=300",
)
"""The tiny recipe as every case and reference trains it; the validation loss at step 2.
Compiled blocks are traced and differentiated by dynamo and AOTAutograd (`aot_eager`), not
turned into inductor kernels: the matrix checks that a compiled layout traces and trains as
one process, in seconds; inductor's kernels are checked by tests/distributed/
test_compile_parity.py."""


def harness_recipe() -> RecipeConfig:
    """The cases' model and run (BASE_OVERRIDES) as a recipe validation can judge; the CPU
    cluster of the tiny recipe."""
    cfg = RecipeConfig(name="tiny")
    cfg.model = ModelConfig(**MODEL, max_seq_len=1024)
    for key, value in TRAIN.items():
        setattr(cfg.train, key, value)
    cfg.cluster.device, cfg.cluster.gpu_type = "cpu", "cpu"
    cfg.compile.backend = "aot_eager"
    return cfg


def case_fields(names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """Every field a case sets: its features' on the harness model, then the world size."""
    features = by_name()
    fields = [pair for name in names for pair in harness_fields(features[name])]
    return fields


def data_parallel(fields: list[tuple[str, Any]]) -> int:
    """Data-parallel ranks of a case: 2 (times HSDP's replicas) when a feature needs them (a
    ZeRO stage, expert parallelism), else 1."""
    given = dict(fields)
    wanted = "parallel.zero" in given or given.get("parallel.ep", 1) > 1
    return 2 * given.get("parallel.dp_replicate", 1) if wanted else 1


def world_size(fields: list[tuple[str, Any]]) -> int:
    """Ranks a case's fields need: its model-parallel degrees times its data parallelism."""
    given = dict(fields)
    model_parallel = given.get("parallel.tp", 1) * given.get("parallel.cp", 1)
    model_parallel *= given.get("parallel.pp", 1)
    return model_parallel * data_parallel(fields)


def global_batch(fields: list[tuple[str, Any]]) -> int:
    """Sequences per step: MICRO_BATCHES per data-parallel rank (V_MICRO_BATCHES under a V
    schedule)."""
    v_shaped = dict(fields).get("parallel.pp_schedule") in ("zbv", "dualpipev")
    return (V_MICRO_BATCHES if v_shaped else MICRO_BATCHES) * data_parallel(fields)


def seq_len(fields: list[tuple[str, Any]]) -> int:
    """Tokens per sequence: RANK_TOKENS on each context-parallel rank."""
    return RANK_TOKENS * dict(fields).get("parallel.cp", 1)


def recipe_of(names: tuple[str, ...]) -> RecipeConfig:
    """The harness recipe with a case's features, on the ranks they need."""
    cfg = copy.deepcopy(harness_recipe())
    fields = case_fields(names)
    for path, value in fields:
        *parents, leaf = path.split(".")
        node: Any = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    cfg.cluster.gpus_per_node = world_size(fields)
    cfg.train.global_batch, cfg.train.seq_len = global_batch(fields), seq_len(fields)
    return cfg


def accepted(names: tuple[str, ...]) -> bool:
    """Whether the case fits its ranks' bound and validation accepts it for a CPU launch."""
    limit = MAX_RANKS_WIDE if WIDE & set(names) else MAX_RANKS
    if world_size(case_fields(names)) > limit:
        return False
    cfg = recipe_of(names)
    try:
        validate(cfg, for_launch=True)
    except RecipeError:
        return False
    return resolve_degrees(cfg).world == cfg.cluster.gpus_per_node


def overrides_of(names: tuple[str, ...]) -> list[str]:
    """The case as command-line overrides on the harness recipe."""
    fields = case_fields(names)
    out = [f"{path}={_value(value)}" for path, value in dict(fields).items()]
    return [
        *out,
        f"cluster.gpus_per_node={world_size(fields)}",
        f"train.global_batch={global_batch(fields)}",
        f"train.seq_len={seq_len(fields)}",
    ]


Reference = tuple[tuple[str, ...], int, int]
"""A run a case is compared with: its features, its global batch and its sequence length."""

SELF_REFERENCED = ("pp 2bw",)
"""Features a case's reference keeps: PipeDream-2BW's numerics differ from synchronous
training by design (each gradient lands one step late), so its cases are compared with the
same schedule at pp=2 alone, which tests/distributed/test_pipedream.py compares with the
one-process simulation of 2BW."""


def reference_of(names: tuple[str, ...]) -> Reference:
    """A case's reference: its numeric features and SELF_REFERENCED ones, in its order (the
    experts' parallel ones, ep and etp, as the experts alone), its global batch and sequence
    length."""
    groups = {f.name: f.group for f in FEATURES}
    kept = [n for n in names if groups[n] in NUMERIC_GROUPS or n in SELF_REFERENCED]
    features = tuple("moe" if groups[n] == "moe" else n for n in kept)
    fields = case_fields(names)
    return features, global_batch(fields), seq_len(fields)


def reference_ranks(reference: Reference) -> int:
    """One process, or the two pipeline ranks of a SELF_REFERENCED schedule."""
    return 2 if set(reference[0]) & set(SELF_REFERENCED) else 1


def reference_overrides(reference: Reference) -> list[str]:
    """The reference's overrides: its features' fields without the degrees of the numeric
    ones (a kept schedule keeps its pp=2)."""
    names, batch, tokens = reference
    fields = dict(case_fields(names))
    pipeline = {k for n in names if n in SELF_REFERENCED for k, _ in harness_fields(by_name()[n])}
    kept = [
        f"{k}={_value(v)}"
        for k, v in fields.items()
        if not k.startswith("parallel.") or k in pipeline
    ]
    return [
        *kept,
        f"cluster.gpus_per_node={reference_ranks(reference)}",
        f"train.global_batch={batch}",
        f"train.seq_len={tokens}",
    ]


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def required_pairs() -> set[frozenset[str]]:
    """Every pair of runnable features the validator accepts together (on the compatibility
    matrix's model: what a user may launch), but for the pairs NOT_ON_CPU."""
    cpu = {f.name for f in runnable()}
    return {
        frozenset(pair)
        for pair, problem in compatibility().items()
        if problem is None and set(pair) <= cpu and frozenset(pair) not in NOT_ON_CPU
    }


def covered(cases: tuple[tuple[str, ...], ...]) -> set[frozenset[str]]:
    """Every pair of features some case holds."""
    return {frozenset(p) for case in cases for p in itertools.combinations(case, 2)}


def _light_if_wide(names: tuple[str, ...]) -> bool:
    """Whether a case keeps to 4 ranks, or to kinds of LIGHT_AT_8."""
    group = {f.name: f.group for f in FEATURES}
    wide = world_size(case_fields(names)) > MAX_RANKS
    return not wide or all(group[n] in LIGHT_AT_8 for n in names)


def generate() -> tuple[tuple[str, ...], ...]:
    """A covering array, greedily: each case starts from an uncovered pair and adds, group by
    group, the feature that covers the most pairs still uncovered while the case stays
    accepted (a case of 8 ranks, kinds of LIGHT_AT_8 only); the cases are ordered by world
    size (one launch each)."""
    features = runnable()
    groups: dict[str, list[str]] = {}
    for f in features:
        groups.setdefault(f.group, []).append(f.name)
    group_of = {f.name: f.group for f in features}
    todo = required_pairs()
    cases: list[tuple[str, ...]] = []
    while todo:
        best: tuple[str, ...] | None = None
        for pair in sorted(tuple(sorted(p)) for p in todo):
            if accepted(pair):
                best = pair
                break
        if best is None:
            raise RuntimeError(f"no case can hold the pairs {sorted(map(sorted, todo))}")
        case = list(best)
        for group, names in groups.items():
            if group in {group_of[n] for n in case}:
                continue
            gains = []
            for name in names:
                new = {frozenset((name, other)) for other in case} & todo
                if new and _light_if_wide((*case, name)) and accepted((*case, name)):
                    gains.append((len(new), name))
            if gains:
                case.append(max(gains, key=lambda g: (g[0], -names.index(g[1])))[1])
        cases.append(tuple(sorted(case, key=[f.name for f in features].index)))
        todo -= covered((cases[-1],))
    return tuple(sorted(cases, key=lambda c: world_size(case_fields(c))))


CASES_START = "# cases: generated by python -m tests.pairwise_cases --write"
CASES_END = "# end of the cases"

# cases: generated by python -m tests.pairwise_cases --write
# fmt: off
CASES: tuple[tuple[str, ...], ...] = (
    ("tp", "cp", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("sp", "ddp", "recompute selective", "compile", "bf16", "ep", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "zero1", "recompute selective", "compile", "bf16", "etp", "mla", "doc mask",
     "loss chunks", "tied", "muon"),
    ("hsdp", "recompute full", "compile", "bf16", "ep", "mla", "doc mask", "loss chunks", "tied",
     "muon"),
    ("tp", "offload", "recompute full", "compile", "bf16", "ep", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "pp 1f1b", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "pp 2bw", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "pp dualpipev", "recompute full", "compile", "bf16", "moe", "mla", "doc mask",
     "loss chunks", "tied", "muon"),
    ("tp", "pp gpipe", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "pp interleaved", "recompute full", "compile", "bf16", "moe", "mla", "doc mask",
     "loss chunks", "tied", "muon"),
    ("tp", "pp zbv", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "pp zero-bubble", "recompute full", "compile", "bf16", "moe", "mla", "doc mask",
     "loss chunks", "tied", "muon"),
    ("tp", "zero2", "recompute full", "compile", "bf16", "etp", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "zero3", "recompute full", "compile", "bf16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "cp", "recompute selective", "compile", "fp16", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "cp", "recompute full", "compile", "fp8", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("tp", "cp", "recompute full", "compile", "mxfp8", "moe", "mla", "doc mask", "loss chunks",
     "tied", "muon"),
    ("cp", "ddp", "recompute full", "fp16", "ep"),
    ("cp", "offload", "recompute selective", "fp8", "moe"),
    ("cp", "pp 1f1b", "recompute selective", "mxfp8"),
    ("cp", "pp 2bw", "recompute selective", "fp16"),
    ("cp", "pp dualpipev", "fp16"),
    ("cp", "pp gpipe", "recompute selective", "fp16"),
    ("cp", "pp interleaved", "recompute selective", "fp16"),
    ("cp", "pp zbv", "fp16"),
    ("cp", "pp zero-bubble", "fp16"),
    ("cp", "zero1", "recompute full", "fp16", "moe"),
    ("cp", "zero2", "recompute selective", "fp16", "moe"),
    ("sp", "ddp", "fp8", "moe"),
    ("sp", "ddp", "mxfp8", "ep"),
    ("pp 1f1b", "ddp", "fp16", "ep"),
    ("pp 2bw", "ddp", "fp8", "ep"),
    ("pp dualpipev", "ddp", "fp8", "ep"),
    ("pp interleaved", "ddp", "fp8", "ep"),
    ("pp zbv", "ddp", "fp8", "ep"),
    ("pp zero-bubble", "ddp", "fp8", "ep"),
    ("pp gpipe", "zero1", "fp8", "ep"),
    ("sp", "zero2", "fp16", "ep"),
    ("pp gpipe", "zero3", "recompute selective", "mxfp8", "ep"),
    ("offload", "fp16", "etp"),
    ("zero2", "fp8", "etp"),
    ("zero1", "mxfp8", "etp"),
    ("hsdp", "fp16"),
    ("pp 1f1b", "zero3", "fp16"),
    ("hsdp", "fp8"),
    ("pp 1f1b", "zero2", "fp8"),
    ("pp interleaved", "zero3", "fp8"),
    ("hsdp", "mxfp8"),
    ("pp interleaved", "offload", "mxfp8"),
    ("pp 2bw", "zero2", "mxfp8"),
    ("pp dualpipev", "zero2", "mxfp8"),
    ("pp zbv", "zero2", "mxfp8"),
    ("pp zero-bubble", "zero2", "mxfp8"),
    ("pp 1f1b", "offload"),
    ("pp dualpipev", "offload"),
    ("pp gpipe", "offload"),
    ("pp zbv", "offload"),
    ("pp zero-bubble", "offload"),
    ("pp 2bw", "zero1"),
    ("pp 2bw", "zero3"),
    ("pp dualpipev", "zero3"),
    ("sp", "pp gpipe"),
    ("pp gpipe", "zero2"),
    ("pp interleaved", "zero2"),
    ("pp zbv", "zero3"),
    ("pp zero-bubble", "zero3"),
    ("sp", "cp", "zero3", "recompute full", "etp"),
    ("cp", "hsdp", "recompute selective", "moe"),
    ("tp", "pp gpipe", "ddp", "etp"),
    ("tp", "hsdp", "etp"),
    ("sp", "pp 1f1b", "zero1", "etp"),
    ("sp", "pp 2bw", "offload", "etp"),
    ("sp", "pp dualpipev", "zero1", "etp"),
    ("sp", "pp interleaved", "zero1", "etp"),
    ("sp", "pp zbv", "zero1", "etp"),
    ("sp", "pp zero-bubble", "zero1", "etp"),
    ("pp 1f1b", "hsdp"),
    ("pp 2bw", "hsdp"),
    ("pp dualpipev", "hsdp"),
    ("pp gpipe", "hsdp"),
    ("pp interleaved", "hsdp"),
    ("pp zbv", "hsdp"),
    ("pp zero-bubble", "hsdp"),
    ("sp", "hsdp"),
)
# fmt: on
# end of the cases


def render(cases: tuple[tuple[str, ...], ...]) -> str:
    """CASES as this file holds it, between CASES_START and CASES_END: a case per line (or
    two, within 100 columns), left as written by the formatter."""
    lines = [CASES_START, "# fmt: off", "CASES: tuple[tuple[str, ...], ...] = ("]
    for case in cases:  # two or more names each: no one-element tuple
        line = "    ("
        for i, name in enumerate(case):
            item = f'"{name}"' + (", " if i < len(case) - 1 else "),")
            if len(line) + len(item.rstrip()) > 100:
                lines.append(line.rstrip())
                line = "     "
            line += item
        lines.append(line)
    lines += [")", "# fmt: on", CASES_END]
    return "\n".join(lines)


def write() -> None:
    """Replace CASES in this file by a freshly generated covering array (formatted by ruff)."""
    text = HERE.read_text()
    start, end = text.index(CASES_START + "\n"), text.index(CASES_END + "\n") + len(CASES_END)
    HERE.write_text(text[:start] + render(generate()) + text[end:])
    subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(HERE)], check=True)


MATRIX_TEST = "tests/distributed/test_pairwise_matrix.py::test_the_case_trains_as_one_process"
PAGE = HERE.resolve().parent.parent / "docs" / "pairwise.md"


def precision_of(names: tuple[str, ...]) -> str:
    """The case's precision: its feature of that kind, or fp32."""
    return next((d for d in ("bf16", "fp16", "fp8", "mxfp8") if d in names), "fp32")


def case_label(names: tuple[str, ...]) -> str:
    """A case's (or a reference's features') name in test ids and run dirs."""
    return "+".join(name.replace(" ", "-") for name in names) or "fp32"


def case_differences(parity_log: Path) -> dict[tuple[str, ...], tuple[float, float]]:
    """Each case's largest relative difference from its reference, (loss or validation loss,
    gradient norm), from a suite run's PRETRAIN_PARITY_LOG (the matrix's test compares the
    loss, the validation loss, the first gradient norm, then every gradient norm)."""
    labels = {case_label(case): case for case in CASES}
    found: dict[tuple[str, ...], list[float]] = {}
    for line in parity_log.read_text().splitlines():
        row = json.loads(line)
        test = row["test"]
        label = test[len(MATRIX_TEST) + 1 : test.rfind("]")]
        if test.startswith(MATRIX_TEST + "[") and label in labels:
            found.setdefault(labels[label], []).append(row["difference"])
    # 2BW's first step logs no norm: its first-norm comparison is not made.
    return {case: (max(d[:2]), max(d[2:])) for case, d in found.items() if len(d) >= 3}


def _by_precision(
    differences: dict[tuple[str, ...], tuple[float, float]],
) -> dict[str, tuple[float, float, int]]:
    """The worst differences of the cases of each precision, and how many cases it has."""
    found: dict[str, tuple[float, float, int]] = {}
    for case, (loss, norm) in differences.items():
        name = precision_of(case)
        old = found.get(name, (0.0, 0.0, 0))
        found[name] = (max(old[0], loss), max(old[1], norm), old[2] + 1)
    return dict(sorted(found.items()))


def render_page(differences: dict[tuple[str, ...], tuple[float, float]]) -> str:
    """docs/pairwise.md: every covered pair with its worst differences, and what is not run."""
    worst: dict[frozenset[str], tuple[float, float]] = {}
    for case, (loss, norm) in differences.items():
        for pair in map(frozenset, itertools.combinations(case, 2)):
            old = worst.get(pair, (0.0, 0.0))
            worst[pair] = (max(old[0], loss), max(old[1], norm))
    order = [f.name for f in FEATURES]
    lines = [
        "# The pairwise matrix: every accepted pair of features, trained",
        "",
        "Generated by `python -m tests.pairwise_cases --page PARITY_LOG` from a suite run with",
        "`PRETRAIN_PARITY_LOG` set; the cases are in [`tests/pairwise_cases.py`]"
        "(../tests/pairwise_cases.py), the test in",
        "[`tests/distributed/test_pairwise_matrix.py`](../tests/distributed/test_pairwise_matrix.py).",
        f"{len(CASES)} cases cover {len(covered(CASES))} pairs of features (the"
        f" {len(required_pairs())} pairs the validator accepts that a CPU run can train among"
        " them). Each pair's",
        "worst relative difference from one process over the cases that hold it: loss or",
        "validation loss / gradient norm.",
        "",
        "A pair's worst is usually that of the lowest precision among its cases. Per",
        "precision, the worst over its cases (loss or validation loss / gradient norm):",
        "",
        *(
            f"- {name}: {loss:.1e} / {norm:.1e} ({count} cases)"
            for name, (loss, norm, count) in _by_precision(differences).items()
        ),
        "",
        "| feature | with | worst loss / gradient norm difference |",
        "| --- | --- | --- |",
    ]
    for a in order:
        partners = [
            b for b in order if b != a and order.index(b) > order.index(a)
            and frozenset((a, b)) in worst
        ]  # fmt: skip
        for b in partners:
            loss, norm = worst[frozenset((a, b))]
            lines.append(f"| {a} | {b} | {loss:.1e} / {norm:.1e} |")
    lines += ["", "Not trained on CPU:", ""]
    lines += [f"- {' with '.join(sorted(names))}: {why}" for names, why in NOT_ON_CPU.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"update CASES in {HERE.name}")
    parser.add_argument("--page", type=Path, metavar="PARITY_LOG", help=f"write {PAGE.name}")
    args = parser.parse_args()
    if args.write:
        write()
    elif args.page:
        PAGE.write_text(render_page(case_differences(args.page)))
    else:
        print(render(generate()))
