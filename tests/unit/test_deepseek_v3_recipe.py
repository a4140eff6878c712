"""The deepseek_v3 recipe: DeepSeek-V3's shape in the layout its report publishes, planned.

DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437): 671B parameters of which
37B are active per token (section 4.2; the checkpoint's 685B add the 14B multi-token
prediction module, left off: the trainer refuses MTP under the V schedules); 2,048 H800
GPUs with 16-way pipeline, 64-way expert parallelism over 8 nodes and ZeRO-1 data
parallelism (section 3.2); a token's experts on at most 4 nodes (section 2.1.2); FP8 with
1 x 128 activation tiles and 128 x 128 weight blocks (section 3.3.2); 15,360 sequences of
4,096 tokens per step (section 4.2).
"""

from __future__ import annotations

import pytest

from pretrain.launcher.plan.plan import make_plan
from pretrain.launcher.validate.recipe import validate
from pretrain.models.flops import count_params
from tests.helpers import compose_recipe


@pytest.fixture(scope="module")
def recipe():
    cfg = compose_recipe("deepseek_v3", [])
    validate(cfg)  # what action=plan checks (a launch also asks for 16 TB of disk)
    return cfg


def test_the_shape_has_the_reports_parameters(recipe) -> None:
    counts = count_params(recipe.model)
    # 671B without the MTP module, as the report counts; ours is a dense block (0.7B), the
    # report's a MoE layer (14B with its experts).
    assert round((counts.total - counts.mtp) / 1e9) == 671
    assert recipe.model.mtp_layers == 1 and round(counts.mtp / 1e9, 1) == 0.7
    assert round(counts.active / 1e9) in (37, 38)  # 37.55B: the report rounds to 37B
    # The checkpoint's config: n_group 8, topk_group 4, routed_scaling_factor 2.5.
    m = recipe.model
    assert (m.moe_groups, m.moe_node_limit, m.moe_route_scale) == (8, 4, 2.5)


def test_the_published_layout_fits_2048_gpus_of_80_gb_with_block_fp8_experts(recipe) -> None:
    plan = make_plan(recipe)
    d = plan.degrees
    assert (d.world, d.pp, d.ep, d.tp, d.dp) == (2048, 16, 64, 1, 128)
    assert plan.gpu_memory_gib == 80 and plan.memory is not None
    assert plan.memory.total_gib < 80
    assert not any("exceeds" in warning for warning in plan.warnings)
    # The ep group spans 8 nodes, and each token reaches at most 4 of them.
    assert plan.ep_comm is not None and plan.ep_comm.nodes_per_token == 4
    assert "the routed experts' grouped GEMMs in FP8" in plan.fp8
    assert plan.fp8.startswith("blockwise scaling")
