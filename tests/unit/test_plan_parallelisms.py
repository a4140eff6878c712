"""The plan of context parallelism, the V schedules, PipeDream-2BW and the experts' own layout:
memory per rank, the ring's traffic and the link it crosses, bubbles, and the layout search
for long sequences."""

from __future__ import annotations

import pytest

from pretrain.core.layout import resolve_degrees
from pretrain.launcher.plan.comm.cp import cp_communication
from pretrain.launcher.plan.memory import head_in_flight, memory_breakdown, stage_params
from pretrain.launcher.plan.plan import LONG_CONTEXT, make_plan
from pretrain.launcher.plan.suggest import search
from pretrain.models.flops import count_params
from tests.helpers import configure

LONG = {"train.seq_len": 8192, "model.max_seq_len": 8192, "train.micro_batch": 1}


def breakdown(overrides: dict, rank: int = 0):
    cfg = configure(overrides)
    degrees = resolve_degrees(cfg)
    micro = cfg.parallel.pp_microbatches or cfg.train.global_batch // (
        cfg.train.micro_batch * degrees.dp
    )
    return memory_breakdown(cfg, degrees, micro, rank)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activation_memory_per_rank_falls_about_1_over_cp(cp: int) -> None:
    alone = breakdown({**LONG, "parallel.zero": 3})
    split = breakdown({**LONG, "parallel.zero": 3, "parallel.cp": cp})
    # Every saved tensor holds s/cp tokens; the ring's backward buffers add up to 10% at
    # cp=8 (one query tile's scores over a chunk, and the K/V and gradient buffers).
    assert 1 / cp <= split.activations / alone.activations <= 1.12 / cp
    assert split.logits == pytest.approx(alone.logits / cp)


def test_ring_traffic_per_layer_is_kv_hops_and_fp32_gradient_hops() -> None:
    cfg = configure({**LONG, "parallel.cp": 4, "parallel.tp": 2, "parallel.zero": 3})
    degrees = resolve_degrees(cfg)
    comm = cp_communication(cfg, degrees)
    # 64 sequences over dp=1 ... this rank's 8192/4 tokens of each; 8 kv heads of 16 dims
    # over tp=2; k and v; fp32: forward 3 hops, backward 3 hops, gradients 4 hops of FP32.
    tokens = cfg.train.global_batch // degrees.dp * 8192 // 4
    kv = 2 * tokens * 8 * 16 / 2
    assert comm.hops == {"forward": 3, "backward": 3, "gradients": 4}
    assert comm.sent_bytes == pytest.approx(kv * (4 * 6 + 4 * 4))
    assert (comm.ring_span, comm.crosses_nodes) == (8, False)


def test_a_ring_wider_than_a_node_is_warned_about() -> None:
    plan = make_plan(configure({**LONG, "parallel.cp": 4, "parallel.tp": 4, "cluster.nodes": 2}))
    assert plan.cp_comm.crosses_nodes
    assert any("context-parallel ring spans tp*cp = 16 ranks" in w for w in plan.warnings)


def test_recompute_under_a_split_backward_schedule_is_warned_about_and_1f1b_is_not() -> None:
    """The dry run's measurement (pp=2, ZeRO-2, the harness model at 256 tokens): zero_bubble's
    last stage holds 68.5 MiB under full recompute, 23.9 MiB without; the plan counts a
    saving, as 1F1B's measures (6.9 MiB)."""
    split = {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "recompute.policy": "full"}
    plan = make_plan(configure(split))
    assert any("the weight pass reads what the input-grad pass recomputed" in w
               for w in plan.warnings)  # fmt: skip
    plain = make_plan(configure({**split, "parallel.pp_schedule": "1f1b"}))
    assert not any("input-grad pass" in w for w in plain.warnings)


def test_a_long_sequence_that_does_not_fit_is_told_the_long_context_order() -> None:
    seq = 4 * LONG_CONTEXT
    plan = make_plan(configure({"train.seq_len": seq, "model.max_seq_len": seq}))
    [warning] = [w for w in plan.warnings if "exceeds" in w]
    assert "pull recompute, then sp (with tp), then parallel.cp, then a smaller" in warning


def test_2bw_holds_two_weight_versions_and_their_gradients() -> None:
    one_pipeline = {"parallel.pp": 2, "cluster.gpus_per_node": 2}
    flushed = breakdown(one_pipeline)
    two_bw = breakdown({**one_pipeline, "parallel.pp_schedule": "2bw"})
    assert two_bw.params == 2 * flushed.params
    assert two_bw.grads == 2 * flushed.grads
    assert two_bw.optimizer == flushed.optimizer  # one set of moments for both versions
    assert "x2 weight versions (2BW)" in two_bw.notes["params"]


def test_2bw_bubble_is_one_fill_per_segment_between_checkpoints() -> None:
    cfg = configure(
        {
            "parallel.pp": 4,
            "parallel.zero": 2,
            "parallel.pp_schedule": "2bw",
            "checkpoint.every": 50,
        }
    )
    plan = make_plan(cfg)
    m, p = plan.pp_microbatches, 4
    assert plan.bubble_fraction == pytest.approx((p - 1) / (50 * m + p - 1))
    assert plan.pipeline["charted_steps"] == 2
    assert plan.pipeline["bubble_fraction"] == pytest.approx(plan.bubble_fraction)


def test_v_schedules_put_the_embedding_and_the_head_on_rank_0() -> None:
    cfg = configure(
        {"parallel.pp": 4, "parallel.vpp": 2, "parallel.pp_schedule": "zbv", "parallel.zero": 2}
    )
    counts = count_params(cfg.model)
    _, root, layers = stage_params(cfg, 0)
    assert root == counts.embedding + counts.final_norm + counts.lm_head
    assert layers == 2  # stages 0 and 7 of 8, one layer each
    assert stage_params(cfg, 3)[1] == 0
    # The last stage's chunk runs F, B, W back to back: one micro-batch of logits at a time.
    assert head_in_flight(cfg, resolve_degrees(cfg), 8) == 1
    chart = make_plan(cfg).pipeline["chart"]
    assert chart.splitlines()[0].split("| ")[1].startswith("F0a F1a")


def test_long_sequences_are_searched_with_cp_and_say_the_levers_in_order() -> None:
    cfg = configure(
        {
            "train.seq_len": LONG_CONTEXT * 2,
            "model.max_seq_len": LONG_CONTEXT * 2,
            "train.micro_batch": 1,
            "train.global_batch": 16,
            "cluster.nodes": 2,
            "precision.dtype": "bf16",
        }
    )
    result = search(cfg, top=20)
    assert any(s.layout.cp > 1 for s in result.suggestions)
    note = result.suggestions[0].long_context
    assert "levers cheapest first: recompute, then SP, then CP, then smaller micro-batch" in note
    with_cp = next(s for s in result.suggestions if s.layout.cp > 1)
    assert f"cp={with_cp.layout.cp}" in with_cp.long_context
    assert "with cp=1 the peak would be" in with_cp.long_context


def test_short_sequences_are_searched_without_cp() -> None:
    result = search(configure({"precision.dtype": "bf16"}), top=50)
    assert all(s.layout.cp == 1 and not s.long_context for s in result.suggestions)


def test_the_rendered_plan_shows_the_ring_and_2bws_two_steps() -> None:
    from pretrain.launcher.plan.report.render import render_plan

    cp = render_plan(make_plan(configure({**LONG, "parallel.cp": 2, "parallel.zero": 3})))
    assert "CP ring per layer per step (one rank)" in cp
    assert "cp=2" in cp
    two_bw = configure({"parallel.pp": 2, "parallel.zero": 2, "parallel.pp_schedule": "2bw"})
    text = render_plan(make_plan(two_bw))
    assert "over 100 steps between drains" in text
    assert "2 steps without a flush" in text


def test_the_rendered_plan_shows_the_expert_layout_and_the_etp_all_reduces() -> None:
    from pretrain.launcher.plan.report.render import render_plan

    experts = {"model.moe_experts": 8, "model.moe_top_k": 2, "parallel.ep": 2}
    layout = {**experts, "parallel.tp": 2, "parallel.etp": 2, "cluster.gpus_per_node": 16}
    cfg = configure(layout)
    plan = make_plan(cfg)
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    assert plan.etp_comm is not None
    assert plan.etp_comm.output_bytes == tokens * cfg.model.dim * 4  # FP32
    assert plan.etp_comm.gate_bytes == tokens * 2 * 4  # top-2 weights, FP32
    text = render_plan(plan)
    assert "│ expert mesh     │ ep=2 x etp=2 x edp=4 " in text
    assert "ETP all-reduces per MoE layer per micro-batch (one rank)" in text
    assert make_plan(configure({**layout, "parallel.etp": 1})).etp_comm is None
