"""Counts far beyond any model or cluster are refused naming the field before the planner
walks them or the ranks allocate them; on CPU, a model this machine cannot hold is refused
against its memory."""

from __future__ import annotations

import time

import pytest

from pretrain.core.problems import Checks, RecipeError
from pretrain.launcher.plan.memory_fit import check_fits, host_memory_gib
from pretrain.launcher.validate.bounds import BOUNDS, check_bounds
from tests.helpers import base, problems


@pytest.mark.parametrize("path", sorted(BOUNDS))
def test_each_count_is_refused_one_past_its_bound(path: str) -> None:
    limit, _ = BOUNDS[path]
    cfg = base()
    cfg.cluster.nodes = cfg.cluster.gpus_per_node = 1  # the world's own bound aside
    section, name = path.split(".")
    setattr(getattr(cfg, section), name, limit + 1)
    c = Checks()
    assert not check_bounds(c, cfg)
    [problem] = c.problems
    assert (problem.field, problem.value) == (path, limit + 1)
    assert problem.fix.startswith(f"use a value <= {limit:,}")
    setattr(getattr(cfg, section), name, limit)
    assert check_bounds(Checks(), cfg)


def test_an_absurd_expert_count_is_refused_at_once_by_the_validator() -> None:
    cfg = base()
    cfg.model.moe_experts, cfg.model.n_layers = 1_000_000_007, 100_000_000
    started = time.monotonic()
    fields = [p.field for p in problems(cfg)]
    assert time.monotonic() - started < 5  # 10^8 layers took half a minute to walk
    assert fields[:2] == ["model.n_layers", "model.moe_experts"]


def test_a_world_of_more_ranks_than_any_cluster_is_refused_though_each_factor_is_within() -> None:
    cfg = base()
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = 2**16, 1024
    c = Checks()
    assert not check_bounds(c, cfg)
    [problem] = c.problems
    assert problem.field == "cluster.nodes" and "67,108,864 ranks" in problem.reason


def test_a_cpu_model_larger_than_this_machine_is_refused_against_its_memory() -> None:
    cfg = base()
    cfg.cluster.device, cfg.cluster.gpu_type, cfg.cluster.gpus_per_node = "cpu", "cpu", 2
    cfg.parallel.tp = 1
    assert host_memory_gib(cfg) is not None
    check_fits(cfg)  # the base model fits
    cfg.model.moe_experts, cfg.model.moe_top_k, cfg.model.n_layers = 16384, 2, 2048
    with pytest.raises(RecipeError) as refused:
        check_fits(cfg)
    assert "this machine's memory per rank (2 local ranks)" in str(refused.value)
    cfg.cluster.backend = "slurm"  # the nodes' memory is not known here
    assert host_memory_gib(cfg) is None
