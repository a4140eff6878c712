"""Layout search: the sanity cases, validity and fit of every suggestion, and the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pretrain.core import hardware
from pretrain.core.layout import rank_groups, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.compute import gpu_kernels, head_seconds
from pretrain.launcher.plan.cost import _tensor_parallel, rank_compute, step_cost
from pretrain.launcher.plan.memory_fit import predict
from pretrain.launcher.plan.suggest import Layout, degrees_of, judge, layouts, search
from pretrain.launcher.validate.recipe import validate
from tests.helpers import validate_and_fit

REPO = Path(__file__).resolve().parents[2]
LLAMA2_7B_SHAPE = ModelConfig(
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096
)


def shipped_model(name: str) -> ModelConfig:
    return ModelConfig(
        **OmegaConf.to_container(OmegaConf.load(REPO / f"recipes/model/{name}.yaml"))
    )


def cluster_recipe(
    model: ModelConfig, nodes: int, global_batch: int, seq_len: int, gpus: int = 8
) -> RecipeConfig:
    cfg = RecipeConfig(name="search", model=model, action="suggest")
    cfg.precision.dtype = "bf16"
    cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu_type = nodes, gpus, "h100_sxm"
    cfg.train.global_batch, cfg.train.seq_len = global_batch, seq_len
    return cfg


@pytest.fixture(scope="module")
def llama70b_on_64() -> RecipeConfig:
    return cluster_recipe(shipped_model("llama3_70b"), nodes=8, global_batch=256, seq_len=8192)


@pytest.fixture(scope="module")
def llama8b_on_8() -> RecipeConfig:
    return cluster_recipe(shipped_model("llama3_8b"), nodes=1, global_batch=256, seq_len=8192)


def nodes_of_groups(cfg: RecipeConfig, layout: Layout, dim: str) -> list[set[int]]:
    gpn = cfg.cluster.gpus_per_node
    return [{rank // gpn for rank in g} for g in rank_groups(degrees_of(layout, cfg))[dim]]


def test_70b_on_64_h100s_keeps_tp_inside_a_node_and_pipelines_across_nodes(llama70b_on_64):
    best = search(llama70b_on_64).suggestions[0].layout
    assert best.tp > 1 and best.pp > 1
    assert all(len(nodes) == 1 for nodes in nodes_of_groups(llama70b_on_64, best, "tp"))
    # Every stage of a pipeline sits on other nodes than its neighbours.
    assert all(len(nodes) == best.pp for nodes in nodes_of_groups(llama70b_on_64, best, "pp"))


@pytest.mark.parametrize(
    ("model", "global_batch", "seq_len"),
    [(shipped_model("llama3_8b"), 256, 8192), (LLAMA2_7B_SHAPE, 64, 4096)],
    ids=["llama3_8b", "llama2_7b_shape"],
)
def test_7b_and_8b_on_one_node_of_8_shard_the_states_and_barely_need_a_pipeline(
    model, global_batch, seq_len
):
    """The fastest layout shards its states over data parallelism (ZeRO-2 or 3), and the
    fastest without a pipeline is within 2% of it: a two-stage pipeline only saves the
    slowdown of ZeRO-3's gathers on the compute they overlap."""
    cfg = cluster_recipe(model, 1, global_batch, seq_len)
    result = search(cfg)
    best = result.suggestions[0]
    assert best.layout.pp <= 2 and best.layout.zero >= 2
    assert best.layout.dp_replicate * best.layout.dp_shard > 1
    links = hardware.links("h100_sxm")
    flat = [
        judge(cfg, layout, result.peak_tflops, links, result.device_gib)[0]
        for layout in layouts(cfg)
        if layout.pp == 1
    ]
    fastest = min((s for s in flat if s is not None), key=lambda s: s.cost.total)
    assert fastest.cost.total <= 1.02 * best.cost.total


def test_suggestions_are_the_requested_count_fastest_first(llama70b_on_64):
    result = search(llama70b_on_64, top=4)
    times = [s.cost.total for s in result.suggestions]
    assert len(times) == 4 and times == sorted(times)
    assert 4 <= result.fitting < result.enumerated


@pytest.mark.parametrize("case", ["llama70b_on_64", "llama8b_on_8"])
def test_every_suggestion_validates_and_its_predicted_peak_fits(case, request):
    cfg = request.getfixturevalue(case)
    device = hardware.gpu_spec(cfg.cluster.gpu_type).memory_gib
    for suggestion in search(cfg).suggestions:
        applied = suggestion.layout.apply(cfg)
        validate_and_fit(applied)
        # The fit check's own path (resolve_degrees, grad_accum_steps) gives the same peak.
        assert predict(applied).total == pytest.approx(suggestion.memory.total)
        assert suggestion.memory.total_gib < device
        assert resolve_degrees(applied) == degrees_of(suggestion.layout, cfg)


def test_the_recipes_own_layout_does_not_matter(llama8b_on_8):
    broken = Layout(3, False, 3, 1, 1, -1, 0, "none", 5).apply(llama8b_on_8)
    with pytest.raises(RecipeError):
        validate(broken)
    assert search(broken).suggestions == search(llama8b_on_8).suggestions


def test_compute_is_the_last_stages_blocks_and_head_and_the_bubble_the_first_stages(llama8b_on_8):
    """The pipeline runs at the pace of its last rank (its blocks and the LM head), and the
    first rank's one micro-batch fills it (launcher/plan/cost.py)."""
    layout = Layout(2, True, 2, 1, 1, 2, 1, "full", 2)
    cfg = layout.apply(llama8b_on_8)
    degrees, micro = degrees_of(layout, cfg), 256 // (2 * 2)
    peak = hardware.peak_tflops("h100_sxm", "bf16")
    cost = step_cost(cfg, degrees, micro, peak, hardware.links("h100_sxm"))
    kernels = gpu_kernels(cfg, peak)
    first, last = (rank_compute(cfg, degrees, kernels, r) for r in (0, 1))
    head_forward, head_backward = head_seconds(kernels, cfg, 2 * 8192, 2)
    assert last.total == pytest.approx(first.total + head_forward + head_backward)
    assert micro * last.total < cost.compute < 1.01 * micro * last.total  # + the optimizer
    # The first rank's TP collectives are its blocks' and the embedding's; the last's, the
    # head's and the vocab-parallel loss's sums besides.
    first_tp = _tensor_parallel(cfg, degrees, hardware.links("h100_sxm"), 0)
    assert first_tp < cost.tp / micro
    assert cost.bubble == pytest.approx(first.total + first_tp + cost.pp_p2p / micro)
    assert cost.tp > 0 and cost.pp_p2p > 0


def test_a_single_rank_has_no_communication():
    cfg = cluster_recipe(LLAMA2_7B_SHAPE, nodes=1, global_batch=8, seq_len=1024, gpus=1)
    layout = Layout(1, False, 1, 1, 1, 1, 0, "none", 1)
    cost = step_cost(layout.apply(cfg), degrees_of(layout, cfg), 8, 989.5, hardware.links("b200"))
    assert cost.communication == 0 and cost.total == cost.compute


def test_hybrid_sharding_keeps_parameter_gathers_on_nvlink():
    cfg = cluster_recipe(shipped_model("llama3_8b"), nodes=4, global_batch=256, seq_len=8192)
    flat, hybrid = (
        Layout(1, False, 1, 1, 1, 32, 3, "full", 1),
        Layout(1, False, 1, 1, 4, 8, 3, "full", 1),
    )
    links, micro = hardware.links("h100_sxm"), 256 // 32
    flat_cost = step_cost(flat.apply(cfg), degrees_of(flat, cfg), micro, 989.5, links)
    hybrid_cost = step_cost(hybrid.apply(cfg), degrees_of(hybrid, cfg), micro, 989.5, links)
    # The same bytes cross 50 GB/s InfiniBand in the flat group and 450 GB/s NVLink in the
    # hybrid one, which only all-reduces an eighth of the gradients between nodes.
    assert hybrid_cost.dp_total < flat_cost.dp_total / 4


def test_a_cpu_cluster_is_refused_with_what_to_set():
    cfg = RecipeConfig(action="suggest")
    cfg.cluster.device = "cpu"
    with pytest.raises(RecipeError, match=r"cluster.device=cpu: .*set cluster.device=cuda"):
        search(cfg)


def test_a_model_that_fits_no_layout_names_the_smallest_peak():
    cfg = cluster_recipe(shipped_model("llama3_70b"), nodes=1, global_batch=64, seq_len=8192)
    with pytest.raises(RecipeError, match=r"cluster.nodes=1: no layout of \d+ fits .* smallest"):
        search(cfg)


def test_suggest_top_below_one_is_refused():
    cfg = RecipeConfig()
    cfg.suggest.top = 0
    with pytest.raises(RecipeError, match=r"suggest.top=0: must be >= 1"):
        validate(cfg)
