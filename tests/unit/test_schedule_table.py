"""Each pipeline schedule's traits are written once, in `core/schedules.py`.

The schema's allowed values, torch's classes and the simulator's orders come from the
table, and no product module names a schedule: a decision that reads
`pp_schedule == "2bw"` or a tuple of schedule names elsewhere would be a second spelling
of a trait, which the grep below refuses.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import torch.distributed.pipelining.schedules as torch_schedules

from pretrain.core.choices import CHOICES
from pretrain.core.field_docs import attribute_docs
from pretrain.core.schedules import LOOP, SCHEDULES, ScheduleTraits, V
from pretrain.core.schema import PP_SCHEDULES, ParallelConfig
from pretrain.launcher.plan.pipeline.schedule_v import TORCH_ORDERS

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("launcher", "trainer", "parallel", "models", "core", "dataprep")
"""The packages that ship (tests and docs may name schedules freely)."""
TABLE = Path("core/schedules.py")


def schedule_literals(root: Path) -> list[str]:
    """`path:line: 'name'` of every string constant outside the table, in the product
    packages under `root`, that is a schedule's name (in a comparison, a tuple, a dict key,
    an argument); prose that mentions one inside a longer message is not such a constant."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if relative == TABLE:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in SCHEDULES:
                    found.append(f"{relative}:{node.lineno}: {node.value!r}")
    return found


def test_no_product_module_outside_the_table_names_a_schedule() -> None:
    assert schedule_literals(REPO) == []


def test_the_grep_finds_a_schedule_named_in_a_decision_but_not_in_prose(tmp_path: Path) -> None:
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "rule.py").write_text(
        'if p.pp_schedule in ("zbv", "dualpipev"):\n'
        '    fix = "set eval.every=0, or use pp_schedule=1f1b"\n'
        'elif p.pp_schedule == "2bw":\n'
        "    pass\n"
    )
    assert schedule_literals(tmp_path) == [
        "launcher/rule.py:1: 'zbv'",
        "launcher/rule.py:1: 'dualpipev'",
        "launcher/rule.py:3: '2bw'",
    ]


def test_the_schema_allows_exactly_the_tables_schedules() -> None:
    (field,) = [f for f in fields(ParallelConfig) if f.name == "pp_schedule"]
    assert PP_SCHEDULES == tuple(SCHEDULES) == field.metadata[CHOICES]
    assert all(traits.name == name for name, traits in SCHEDULES.items())


def test_every_trait_has_a_docstring() -> None:
    assert set(attribute_docs(ScheduleTraits)) == {f.name for f in fields(ScheduleTraits)}


def test_each_torch_class_is_a_pipelining_schedule_with_the_tables_stage_count() -> None:
    for traits in SCHEDULES.values():
        if traits.torch_class is None:
            continue
        cls = getattr(torch_schedules, traits.torch_class)
        multi = issubclass(cls, torch_schedules.PipelineScheduleMulti)
        assert multi == traits.multi_stage, traits.name
        assert multi or issubclass(cls, torch_schedules.PipelineScheduleSingle), traits.name


def test_every_simulated_schedule_has_an_in_repo_order_and_the_rest_a_closed_form() -> None:
    for traits in SCHEDULES.values():
        own_order = traits.torch_class in TORCH_ORDERS or not traits.flushes
        assert traits.simulated == own_order, traits.name
        # The closed forms cover the looped placement only.
        assert traits.simulated or traits.placement == LOOP, traits.name


def test_v_placement_holds_exactly_two_chunks_per_rank() -> None:
    for traits in SCHEDULES.values():
        assert traits.placement in (LOOP, V), traits.name
        assert (traits.placement == V) == (traits.chunks_per_rank == 2), traits.name
