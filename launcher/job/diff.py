"""`pretrain diff RUN_A RUN_B`: what differs between two runs, read from their run dirs.

The config (as override-style `field=value` pairs, `run.dir` aside since two run dirs always
differ in it), the overrides each was launched with, the code (git commit and dirty flag,
or the installed version), the environment (package versions), the hosts, the plan, and
where the curves part: the first step both logged at which the losses differ by more than
`--rtol` relative. A run dir written before the ledger existed says so and is still
compared in what it has. Text, or one JSON object with `--format json`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.launcher.job.run_record import RunRecord, read_run

DEFAULT_RTOL = 1e-4
"""Relative loss difference beyond which two curves part: above FP32 rounding between
layouts (1e-5, tests/distributed/harness.py) and across Pythons (1e-4, the golden curves)."""
IDENTITY_FIELDS = ("run.dir",)
"""Config fields that name the run itself, left out of the comparison."""
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./@:+-]+")


def override_value(value: Any) -> str:
    """`value` as it would be written in a command-line override (`optim.lr=0.003`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN_WORD.fullmatch(text) and not _reads_as_other_than_text(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _reads_as_other_than_text(text: str) -> bool:
    """Whether an unquoted override would read `text` as a number, a bool or null."""
    if text.lower() in ("true", "false", "null"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def changed(a: dict[str, Any], b: dict[str, Any], skip: tuple[str, ...] = ()) -> list[dict]:
    """Each field whose value differs, in A's order then B's: `{"field", "a", "b"}`, a side
    left out where that map lacks the field."""
    rows = []
    for key in dict.fromkeys([*a, *b]):
        if key in skip or (key in a and key in b and a[key] == b[key]):
            continue
        row: dict[str, Any] = {"field": key}
        row.update({side: m[key] for side, m in (("a", a), ("b", b)) if key in m})
        rows.append(row)
    return rows


def _first(records: list[dict], kind: str | None = None) -> dict:
    return next((r for r in records if kind is None or r.get("kind") == kind), {})


def code_of(record: dict) -> str:
    """A ledger record's code version as one phrase: `git 073bfd90bfef, dirty`, `version 0.1.0`."""
    code = record.get("code")
    if not isinstance(code, dict):
        return "unknown"
    if isinstance(code.get("git_commit"), str):
        return f"git {code['git_commit'][:12]}" + (", dirty" if code.get("dirty") else "")
    return f"version {code.get('version', 'unknown')}"


def hosts_of(records: list[dict]) -> list[str]:
    """Every host a job of the run ran on, in order; a local launch's host when no job
    started yet."""
    jobs = [r.get("hosts") for r in records if r.get("kind") == "job"]
    hosts = [h for listed in jobs if isinstance(listed, list) for h in listed]
    if not hosts:
        launch = _first(records, "launch")
        if launch.get("backend") == "local" and isinstance(launch.get("host"), str):
            hosts = [launch["host"]]
    return [str(h) for h in dict.fromkeys(hosts)]


@dataclass(frozen=True)
class Parting:
    """Where two loss curves part, or that they do not over the steps both logged."""

    common_steps: int
    step: int | None
    a: float | None
    b: float | None
    rtol: float


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None  # both not finite: no finite loss to part from
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def parting(a: dict[int, float | None], b: dict[int, float | None], rtol: float) -> Parting:
    """The first step both curves logged at which their losses are not within `rtol`."""
    common = sorted(a.keys() & b.keys())
    for step in common:
        if not _close(a[step], b[step], rtol):
            return Parting(len(common), step, a[step], b[step], rtol)
    return Parting(len(common), None, None, None, rtol)


def compare(a: RunRecord, b: RunRecord, rtol: float = DEFAULT_RTOL) -> dict[str, Any]:
    """Everything `pretrain diff` reports, as one JSON-shaped dict."""
    notes = []
    out: dict[str, Any] = {"a": str(a.path), "b": str(b.path)}
    out["config"] = changed(a.config, b.config, IDENTITY_FIELDS)
    out["overrides"] = {"a": a.overrides, "b": b.overrides}
    out["recipes"] = {"a": a.recipe, "b": b.recipe}
    for side, run in (("A", a), ("B", b)):
        versions = list(dict.fromkeys(code_of(r) for r in run.ledger or []))
        if len(versions) > 1:
            notes.append(f"{side} ran under {len(versions)} code versions, in this order: "
                         f"{'; '.join(versions)}")  # fmt: skip
        if run.ledger is None:
            notes.append(f"{side} has no ledger.jsonl (a run dir from a version before the "
                         "ledger): its code, environment and hosts are unknown")  # fmt: skip
        if run.plan is None:
            notes.append(f"{side} has no plan.json: the plans are not compared")
        if run.overrides is None:
            notes.append(f"{side} has no overrides.yaml: the command lines are not compared")
        if run.losses is None:
            notes.append(f"{side} has no metrics.jsonl: the curves are not compared")
    if a.ledger is not None and b.ledger is not None:
        # The code and environment a job saw are what trained; before a job, the launcher's.
        env_a, env_b = (_first(r, "job") or _first(r) for r in (a.ledger, b.ledger))
        out["code"] = {"a": code_of(env_a), "b": code_of(env_b)}
        out["environment"] = changed(_packages(env_a), _packages(env_b))
        out["packages"] = {"a": _packages(env_a), "b": _packages(env_b)}
        out["hosts"] = {"a": hosts_of(a.ledger), "b": hosts_of(b.ledger)}
    if a.plan is not None and b.plan is not None:
        out["plan"] = changed(a.plan, b.plan)
    if a.losses is not None and b.losses is not None:
        part = parting(a.losses, b.losses, rtol)
        out["curves"] = {
            "rtol": rtol,
            "common_steps": part.common_steps,
            "parting_step": part.step,
            "loss_a": part.a,
            "loss_b": part.b,
            "steps_a": len(a.losses),
            "steps_b": len(b.losses),
        }
    out["notes"] = notes
    return out


def _packages(record: dict) -> dict[str, Any]:
    packages = record.get("packages")
    return packages if isinstance(packages, dict) else {}


def _pairs(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        for mark, side in (("-", "a"), ("+", "b")):
            value = override_value(row[side]) if side in row else "(absent)"
            lines.append(f"  {mark} {row['field']}={value}")
    return lines


def _section(title: str, rows: list[dict], same: str) -> list[str]:
    if not rows:
        return [f"{title}: the same{same}"]
    return [f"{title}: {len(rows)} differ{'s' if len(rows) == 1 else ''}", *_pairs(rows)]


def render(diff: dict[str, Any]) -> str:
    """The text of `pretrain diff`: `-` lines are A's, `+` lines B's."""
    lines = [f"A: {diff['a']}", f"B: {diff['b']}"]
    lines += _section(f"config ({', '.join(IDENTITY_FIELDS)} aside)", diff["config"], "")
    lines += _overrides_lines(diff["overrides"]["a"], diff["overrides"]["b"])
    if "code" in diff:
        code = diff["code"]
        lines.append(
            f"code: the same ({code['a']})"
            if code["a"] == code["b"]
            else f"code: differs\n  - {code['a']}\n  + {code['b']}"
        )
        env = ", ".join(f"{k} {v}" for k, v in diff["packages"]["a"].items())
        lines += _section("environment", diff["environment"], f" ({env})")
        hosts = diff["hosts"]
        lines.append(
            f"hosts: the same ({', '.join(hosts['a']) or 'none yet'})"
            if hosts["a"] == hosts["b"]
            else f"hosts: differ\n  - {', '.join(hosts['a']) or 'none yet'}\n"
            f"  + {', '.join(hosts['b']) or 'none yet'}"
        )
    if "plan" in diff:
        lines += _section("plan", diff["plan"], "")
    if "curves" in diff:
        lines.append(_curves_line(diff["curves"]))
    lines += [f"note: {n}" for n in diff["notes"]]
    return "\n".join(lines)


def _overrides_lines(a: list[str] | None, b: list[str] | None) -> list[str]:
    """The command lines' overrides that only one run was launched with."""
    if a is None or b is None:
        return []  # said in a note
    only_a, only_b = [o for o in a if o not in b], [o for o in b if o not in a]
    if not only_a and not only_b:
        return ["overrides: the same"]
    return ["overrides: launched with", f"  - {' '.join(only_a)}", f"  + {' '.join(only_b)}"]


def _curves_line(c: dict[str, Any]) -> str:
    within = f"loss within {c['rtol']:g} relative"
    if not c["common_steps"]:
        return f"curves: no step logged by both (A {c['steps_a']}, B {c['steps_b']} steps)"
    if c["parting_step"] is None:
        return f"curves: the same at all {c['common_steps']} steps both logged ({within})"
    a, b = c["loss_a"], c["loss_b"]
    shown = [f"{v:.6g}" if v is not None else "not finite" for v in (a, b)]
    rel = ""
    if a is not None and b is not None:
        rel = f", relative difference {abs(a - b) / max(abs(a), abs(b)):.2g}"
    return (
        f"curves: part at step {c['parting_step']}: loss {shown[0]} (A) vs {shown[1]} (B)"
        f"{rel}, more than --rtol {c['rtol']:g} (of {c['common_steps']} steps both logged)"
    )


def _rtol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0; e.g. 1e-4")
    return value


def main(argv: list[str]) -> int:
    """`pretrain diff RUN_A RUN_B [--format text|json] [--rtol R]`: print what differs; 0 when
    both were read (whether or not they differ), 2 when one is no run dir."""
    parser = argparse.ArgumentParser(
        prog="pretrain diff",
        description="What differs between two runs: config, overrides, code, environment, "
        "hosts, plan, and the first step at which their losses part.",
    )
    parser.add_argument("run_a", type=Path, help="a run dir")
    parser.add_argument("run_b", type=Path, help="the run dir to compare it with")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--rtol",
        type=_rtol,
        default=DEFAULT_RTOL,
        help=f"relative loss difference at which the curves part (default {DEFAULT_RTOL:g})",
    )
    args = parser.parse_args(argv)
    diff = compare(read_run(args.run_a), read_run(args.run_b), args.rtol)
    print(json.dumps(diff) if args.format == "json" else render(diff))
    return 0
