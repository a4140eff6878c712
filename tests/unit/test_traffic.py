"""The cost model's collectives as bytes per kind and step for one rank
(launcher/plan/comm/traffic.py, tp_comm.block_collectives); the dry run sets them beside what it
counts (tests/unit/test_dryrun.py)."""

from __future__ import annotations

import pytest

from pretrain.core.layout import resolve_degrees
from pretrain.launcher.plan.comm.tp import block_calls, block_collectives, root_collectives
from pretrain.launcher.plan.comm.traffic import step_traffic, wire_bytes
from tests.helpers import compose_recipe, configure

BF16 = 2


def kinds(calls: list[tuple[str, float]]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for kind, _ in calls:
        counted[kind] = counted.get(kind, 0) + 1
    return counted


def tp_layout(policy: str, sp: bool = True):
    cfg = configure({"parallel.tp": 4, "parallel.sp": sp, "recompute.policy": policy})
    return cfg, resolve_degrees(cfg)


def test_selective_recompute_gathers_the_inputs_again_and_reduces_no_output_again():
    """parallel/recompute.py keeps the row-parallel outputs' reduce-scatters, not their
    partial sums: the recomputation issues only the column inputs' all-gathers."""
    cfg, degrees = tp_layout("none")
    plain = kinds(block_collectives(cfg, degrees, 0, 1.0))
    assert plain == {"all_gather": 4, "reduce_scatter": 4}
    cfg, degrees = tp_layout("selective")
    assert kinds(block_collectives(cfg, degrees, 0, 1.0)) == {"all_gather": 6, "reduce_scatter": 4}
    cfg, degrees = tp_layout("full")
    assert kinds(block_collectives(cfg, degrees, 0, 1.0)) == {"all_gather": 6, "reduce_scatter": 5}


def test_without_sp_a_block_all_reduces_two_outputs_and_two_input_gradients():
    cfg, degrees = tp_layout("selective", sp=False)
    calls = block_collectives(cfg, degrees, 0, 1.0)
    assert kinds(calls) == {"all_reduce": 4}
    # Each hands in the whole activation: tokens x dim in the compute dtype (FP32 here).
    assert {size for _, size in calls} == {4 * cfg.model.dim}


def test_sp_moves_what_all_reduces_would_on_the_wire():
    cfg, degrees = tp_layout("none")
    sp = sum(wire_bytes(kind, 4, size) for kind, size in block_collectives(cfg, degrees, 0, 1.0))
    cfg, degrees = tp_layout("none", sp=False)
    plain = sum(wire_bytes(kind, 4, size) for kind, size in block_collectives(cfg, degrees, 0, 1.0))
    assert sp == pytest.approx(plain)


def test_the_embedding_and_the_head_reduce_on_their_stages_and_the_loss_sums_three_floats():
    cfg, degrees = tp_layout("selective")
    assert kinds(root_collectives(cfg, degrees, first=True, last=False, tokens=1.0)) == {
        "reduce_scatter": 1,
        "all_gather": 1,
    }
    last = kinds(root_collectives(cfg, degrees, first=False, last=True, tokens=1.0))
    assert last == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 3}


def test_llama3_8b_step_traffic_by_kind():
    """tp8 sp, ZeRO-2 over 4, 32 layers, selective; two micro-batches of 8,192 tokens."""
    cfg = compose_recipe("llama3_8b", ["train.global_batch=8"])
    degrees = resolve_degrees(cfg)
    traffic = step_traffic(cfg, degrees, 2, 0)
    tokens, dim, layers = 2 * 8192, 4096, 32
    activation = tokens * dim * BF16
    # Blocks: 6 gathers of 1/8 and 4 reduce-scatters of the whole activation each; the
    # embedding and the head one of each. FSDP gathers the BF16 shards once and
    # reduce-scatters the FP32 gradients once.
    dense = traffic.by_source["dp"]["reduce_scatter"] / 4
    assert traffic.by_source["tp"] == pytest.approx(
        {
            "all_gather": (6 * layers + 2) * activation / 8,
            "reduce_scatter": (4 * layers + 2) * activation,
            # The loss's three sums per token; once per step, the norms' FP32 gradients
            # (replicated weights over the sequence-sharded stream: partial sums over tp).
            "all_reduce": 3 * 4 * tokens + (2 * layers + 1) * dim * 4,
        }
    )
    assert traffic.by_source["dp"]["all_gather"] == pytest.approx(BF16 * dense / 4)
    assert dense == pytest.approx(8.03e9 / 8, rel=0.02)


def test_a_middle_pipeline_stage_sends_and_receives_an_activation_and_a_gradient():
    cfg = compose_recipe("llama3_70b", ["train.global_batch=8"])
    degrees = resolve_degrees(cfg)
    traffic = step_traffic(cfg, degrees, 4, 1)
    hidden = 4 * 8192 // 8 * 8192 * BF16  # four micro-batches, sequence-sharded over tp 8
    assert traffic.by_source["pp"] == {"send": 2 * hidden, "recv": 2 * hidden}
    assert "pp" not in step_traffic(configure({}), resolve_degrees(configure({})), 1, 0).by_source


def test_expert_all_to_alls_repeat_in_a_recomputed_block():
    cfg = compose_recipe("mixtral_8x7b", ["train.global_batch=32"])
    degrees = resolve_degrees(cfg)
    full = step_traffic(cfg, degrees, 2, 0).by_kind["all_to_all"]
    cfg.recompute.policy = "none"
    assert full / step_traffic(cfg, degrees, 2, 0).by_kind["all_to_all"] == pytest.approx(6 / 4)
    cfg.recompute.policy = "selective"
    assert step_traffic(cfg, degrees, 2, 0).by_kind["all_to_all"] == pytest.approx(full)


def test_key_value_heads_fewer_than_tp_all_reduce_their_whole_weights_gradients():
    """parallel/tensor.py `_OneKVHead`: every rank holds the whole K and V weights, whose
    gradients are summed over tp once per micro-batch (a dry run of tp4 over 2 KV heads
    counted the same bytes)."""
    cfg, degrees = tp_layout("none")
    cfg.model.n_kv_heads = 2
    calls = block_collectives(cfg, degrees, 0, 1.0)
    m = cfg.model
    weights = [size for kind, size in calls if kind == "all_reduce"]
    assert weights == [4 * 2 * m.head_dim * m.dim] * 2  # K and V, FP32 parameters


def test_the_multi_token_prediction_modules_add_their_embedding_block_and_head_on_the_last():
    cfg, degrees = tp_layout("selective")
    plain = kinds(root_collectives(cfg, degrees, first=False, last=True, tokens=1.0))
    cfg.model.mtp_layers = 2
    mtp = kinds(root_collectives(cfg, degrees, first=False, last=True, tokens=1.0))
    block = kinds(block_calls(cfg, degrees, False, False, 1.0))
    # Per depth: an embedding and a head share (a reduce-scatter and a gather each), the
    # loss's three sums, and a block as no recompute runs it.
    assert mtp["reduce_scatter"] == plain["reduce_scatter"] + 2 * (2 + block["reduce_scatter"])
    assert mtp["all_gather"] == plain["all_gather"] + 2 * (2 + block["all_gather"])
    assert mtp["all_reduce"] == plain["all_reduce"] + 2 * 3
    assert not kinds(root_collectives(cfg, degrees, first=False, last=False, tokens=1.0))
