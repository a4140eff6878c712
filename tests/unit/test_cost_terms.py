"""The cost model's compute, data-parallel, expert and latency terms, each against the figure
its source states (launcher/plan/compute.py, launcher/plan/cost.py, launcher/plan/comm/ep.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pretrain.core import hardware
from pretrain.core.layout import Degrees, grad_accum_steps, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.comm.ep import ep_communication
from pretrain.launcher.plan.compute import (
    ACTIVATION_BYTES,
    BACKWARD_BYTES,
    Kernels,
    block_seconds,
    block_work,
    gpu_kernels,
    head_seconds,
    optimizer_seconds,
)
from pretrain.launcher.plan.cost import (
    LINK_EFFICIENCY,
    OVERLAP_SLOWDOWN,
    _optimizer_params,
    fsdp_calls,
    recipe_links,
    step_cost,
)
from pretrain.launcher.plan.memory import dispatch_padding
from pretrain.launcher.plan.suggest import layouts, render_search, search, three_terms
from pretrain.models.flops import count_params
from tests.helpers import LLAMA3_8B, compose_recipe

PEAK = 989.5
H100 = hardware.links("h100_sxm")
assert H100 is not None
# Mixtral 8x22B (mistralai/Mixtral-8x22B-v0.1 config.json): 56 layers of 6144, 48 heads,
# 8 KV heads, 8 experts of 16384 with top-2 routing, vocabulary 32768.
MIXTRAL_8X22B = ModelConfig(
    vocab_size=32768, dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384,
    max_seq_len=4096, moe_experts=8, moe_top_k=2,
)  # fmt: skip


# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json).
MIXTRAL_8X7B = ModelConfig(
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    max_seq_len=4096, moe_experts=8, moe_top_k=2,
)  # fmt: skip


def recipe(model: ModelConfig, nodes: int, **parallel: int) -> RecipeConfig:
    cfg = RecipeConfig(name="cost", model=model, action="plan")
    cfg.precision.dtype = "bf16"
    cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu_type = nodes, 8, "h100_sxm"
    cfg.train.seq_len, cfg.train.micro_batch = 4096, 1
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg


def degrees(cfg: RecipeConfig) -> Degrees:
    p, world = cfg.parallel, cfg.cluster.nodes * cfg.cluster.gpus_per_node
    shard = world // (p.pp * p.dp_replicate * p.tp * p.cp)
    return Degrees(p.pp, p.dp_replicate, shard, p.tp, p.ep, world, p.cp, p.etp)


def dp_total(cfg: RecipeConfig, microbatches: int) -> float:
    cfg.train.global_batch = microbatches * degrees(cfg).dp
    return step_cost(cfg, degrees(cfg), microbatches, PEAK, H100).dp_total


def test_zero2_gathers_the_parameters_once_per_step_whatever_the_accumulation() -> None:
    """Megatron-LM's distributed optimizer (docs/source/api-guide/dist_optimizer.md) and
    FSDP2 without reshard_after_forward all-gather the parameters once per step: with 32
    micro-batches the data-parallel traffic is that of one (issue 25 item 1: the per
    micro-batch gather made 340B-462B PP layouts look 20-45% slower than they ran)."""
    cfg = recipe(LLAMA3_8B, nodes=2, zero=2)
    assert dp_total(cfg, 32) == pytest.approx(dp_total(cfg, 1))


def test_zero3_gathers_every_block_in_each_micro_batchs_forward_and_backward() -> None:
    """FSDP2 with reshard_after_forward (ZeRO-3) all-gathers each block before its forward
    and again before its backward (Zhao et al. 2023, "PyTorch FSDP", section 3.2): 31 more
    micro-batches add 62 gathers of the rank's BF16 parameters, (n-1)/n of them received
    over InfiniBand (16 ranks on two nodes)."""
    cfg = recipe(LLAMA3_8B, nodes=2, zero=3)
    one_gather = 2 * count_params(LLAMA3_8B).total * 15 / 16 / (50e9 * LINK_EFFICIENCY)
    assert dp_total(cfg, 32) - dp_total(cfg, 1) == pytest.approx(62 * one_gather, rel=1e-6)


def test_expert_gradients_reduce_over_their_expert_data_parallel_group_only() -> None:
    """Expert gradients are summed over the ranks holding the same experts, world / (ep x
    etp x pp) of them (Megatron-Core MoE docs, "expert data parallelism"; DeepSpeed-MoE,
    Rajbhandari et al. 2022, section 5). With ep = dp = 8 there is one such rank, so DDP's
    all-reduce moves the dense parameters' FP32 gradients alone: 2 (n-1)/n of 4 bytes per
    dense parameter over NVLink (issue 25 item 2: 13 s of traffic on a Mixtral-8x22B
    layout came from costing the experts as dense)."""
    cfg = recipe(MIXTRAL_8X22B, nodes=8, tp=1, pp=8, ep=8, zero=0)
    counts = count_params(MIXTRAL_8X22B)
    assert counts.experts > 0.9 * counts.total  # the experts are most of the model
    # The largest stage: the first or the last (embedding or head), 7 of the 56 layers.
    blocks = (counts.layers - counts.experts) * 7 // 56
    dense = blocks + max(counts.embedding, counts.final_norm + counts.lm_head)
    expected = 2 * 4 * dense * 7 / 8 / (450e9 * LINK_EFFICIENCY)
    assert dp_total(cfg, 8) == pytest.approx(expected, rel=1e-6)


def test_the_expert_all_to_all_moves_tokens_times_dim_times_top_k_four_times() -> None:
    """Dispatch and combine each move every token's top_k rows of dim over the ep group,
    forward and backward (GShard, Lepikhin et al. 2020, section 3.2; the DeepSeek-V3
    technical report, section 3.2.2): per MoE layer and micro-batch four all-to-alls of
    s x k x h BF16 rows, (ep-1)/ep of them sent, here across nodes (ep = 16 > 8 GPUs).
    The 2x is the trainer's dropless slots (parallel/expert.py SLOT_START)."""
    cfg = recipe(MIXTRAL_8X22B, nodes=2, tp=1, pp=1, ep=16, zero=3)
    cfg.train.global_batch = 16
    cost = step_cost(cfg, degrees(cfg), 1, PEAK, H100)
    rows = 4096 * 2 * 2.0
    one = rows * 6144 * 2 * 15 / 16 / (50e9 * LINK_EFFICIENCY) + 5e-6
    assert cost.ep == pytest.approx(56 * 4 * one, rel=1e-6)


def test_node_limited_routing_bounds_the_rows_leaving_a_node() -> None:
    """DeepSeek-V3 (technical report, section 3.2.2): a token sent to at most M nodes
    crosses the network once per remote node. Top-8 of 64 experts over ep = 32 ranks on 4
    nodes, M = 2: 4096 tokens x 2 nodes x 6144 x 2 bytes x 3/4 remote, against 4 nodes
    unlimited; the all-to-all still sends every assignment's row, so its bytes do not move."""
    shape = dataclasses.replace(MIXTRAL_8X22B, moe_experts=64, moe_top_k=8)
    limited = recipe(dataclasses.replace(shape, moe_node_limit=2), nodes=4, tp=1, pp=1, ep=32)
    plain = recipe(shape, nodes=4, tp=1, pp=1, ep=32)
    got, unlimited = (
        ep_communication(limited, degrees(limited)),
        ep_communication(plain, degrees(plain)),
    )
    assert got is not None and unlimited is not None
    assert (got.nodes_per_token, unlimited.nodes_per_token) == (2, 4)
    assert got.inter_node_bytes == 4096 * 2 * 6144 * 2 * 3 / 4 == 75_497_472
    assert unlimited.inter_node_bytes == 2 * got.inter_node_bytes
    assert got.message_bytes == unlimited.message_bytes


def test_full_recompute_repeats_the_forward_dispatch_and_combine() -> None:
    """A fully recomputed block runs its forward again in backward, with its two
    all-to-alls (Megatron-Core MoE docs: recompute of the MoE layer re-dispatches)."""
    plain = recipe(MIXTRAL_8X22B, nodes=1, tp=1, pp=1, ep=8, zero=3)
    plain.train.global_batch = 8
    full = dataclasses.replace(plain.recompute, policy="full")
    again = dataclasses.replace(plain, recompute=full)
    first = step_cost(plain, degrees(plain), 1, PEAK, H100).ep
    assert step_cost(again, degrees(again), 1, PEAK, H100).ep == pytest.approx(1.5 * first)


def test_expert_tensor_parallelism_splits_the_routed_experts_work_for_two_all_reduces() -> None:
    """etp = tp = 8 splits each routed expert's three matmuls over the 8 ranks of a node
    (Megatron-Core's expert tensor parallelism): the rank runs the k = 2 experts' GEMMs at
    1/8 of their hidden width (each GEMM priced at its own shape, forward and the two of
    backward), and pays per MoE layer and micro-batch two all-reduces of s x h BF16 (the
    routed output, its input's gradient) and one of s x k FP32 (the routing weights'
    gradient), 2 (8-1)/8 of each over NVLink in 14 steps of 2 us."""
    whole = recipe(MIXTRAL_8X22B, nodes=1, tp=8, pp=1, zero=3)
    split = recipe(MIXTRAL_8X22B, nodes=1, tp=8, pp=1, zero=3, etp=8)
    whole.train.global_batch = split.train.global_batch = 1
    before = step_cost(whole, degrees(whole), 1, PEAK, H100)
    after = step_cost(split, degrees(split), 1, PEAK, H100)
    kernels = gpu_kernels(whole, PEAK)
    m, experts = MIXTRAL_8X22B, MIXTRAL_8X22B.moe_experts
    rows = 4096 * m.moe_top_k * dispatch_padding(whole) / experts

    def routed_seconds(width: int) -> float:
        linears = ((m.dim, width), (m.dim, width), (width, m.dim))  # (k, n): gate, up, down
        return experts * sum(
            kernels.gemm(rows, n, k, "bf16")
            + kernels.gemm(rows, k, n, "bf16")
            + kernels.gemm(k, n, rows, "bf16")
            for k, n in linears
        )

    # SwiGLU's element-wise work over the routed rows shrinks with their width, forward and
    # backward.
    narrower = 4096 * m.moe_top_k * dispatch_padding(whole) * m.expert_ffn_dim * 7 / 8
    activation = kernels.memory(ACTIVATION_BYTES * 3 * narrower) * (1 + BACKWARD_BYTES)
    saved = routed_seconds(m.expert_ffn_dim) - routed_seconds(m.expert_ffn_dim // 8) + activation
    assert saved > 0
    assert before.compute - after.compute == pytest.approx(56 * saved, rel=1e-9)
    sent = (2 * 4096 * 6144 * 2 + 4096 * 2 * 4) * 2 * 7 / 8 / (450e9 * LINK_EFFICIENCY)
    assert after.tp - before.tp == pytest.approx(56 * (sent + 3 * 14 * 2e-6), rel=1e-9)


def test_pipeline_sends_cost_a_latency_each_however_small() -> None:
    """A send is never free: with zero-sized activations a pipeline of 16 stages over 16
    nodes still pays one inter-node latency (NCCL's IB transport, about 5 us) per send,
    two per micro-batch."""
    tiny = ModelConfig(vocab_size=64, dim=64, n_layers=16, n_heads=4, ffn_dim=128, max_seq_len=16)
    cfg = recipe(tiny, nodes=16, pp=16, tp=8, zero=0)
    cfg.train.seq_len, cfg.train.global_batch = 16, 32
    cost = step_cost(cfg, degrees(cfg), 32, PEAK, H100)
    assert cost.pp_p2p >= 32 * 2 * 5e-6


def test_the_recipes_link_figures_replace_the_gpu_tables() -> None:
    """`hardware.*` link fields override the table; 0 keeps it (H800: 400 GB/s NVLink,
    bidirectional, per the H800 product brief; 160 GB/s measured in the DeepSeek-V3 report)."""
    cfg = recipe(LLAMA3_8B, nodes=1)
    assert recipe_links(cfg, "h800") == hardware.Links(200.0, 50.0)
    cfg.hardware.inter_node_gbs, cfg.hardware.inter_node_latency_us = 25.0, 8.0
    links = recipe_links(cfg, "h800")
    assert links is not None
    assert (links.intra_node_gbs, links.inter_node_gbs, links.inter_node_latency_us) == (
        200.0,
        25.0,
        8.0,
    )
    assert hardware.match_device_name("NVIDIA H800") == "h800"


def suggest_recipe(model: ModelConfig, gpus: int, seq: int) -> RecipeConfig:
    cfg = recipe(model, nodes=gpus // 8)
    cfg.action = "suggest"
    cfg.train.seq_len, cfg.train.global_batch = seq, 2048
    cfg.model = dataclasses.replace(model, max_seq_len=seq)
    return cfg


def test_the_search_tries_cp_from_8k_tokens_and_across_nodes() -> None:
    """Context parallelism pays from 8k tokens on large runs (issue 25: a published 405B
    run used TP8 CP2 at 8k); tp8 x cp2 spans two nodes of 8 GPUs."""
    seen = {(lay.tp, lay.cp) for lay in layouts(suggest_recipe(LLAMA3_8B, 64, 8192))}
    assert (8, 2) in seen and (1, 16) in seen
    shorter = layouts(suggest_recipe(LLAMA3_8B, 64, 4096))
    assert {lay.cp for lay in shorter} == {1}


def test_the_search_tries_every_expert_parallel_degree_and_prints_three_terms() -> None:
    """ep is searched (1 to the 8 experts of Mixtral 8x7B), and each suggestion states its
    step as compute + exposed communication + bubble, which add up to its step time."""
    cfg = suggest_recipe(MIXTRAL_8X7B, 16, 4096)
    assert {lay.ep for lay in layouts(cfg)} == {1, 2, 4, 8}
    cfg.suggest.top = 2
    result = search(cfg)
    text = render_search(cfg, result)
    for suggestion in result.suggestions:
        terms = three_terms(suggestion.cost)
        assert sum(terms.values()) == pytest.approx(suggestion.cost.total)
        assert f"step: compute {terms['compute']:.2f} s + exposed communication" in text


def h100_kernels(dtype: str = "bf16") -> Kernels:
    cfg = recipe(LLAMA3_8B, nodes=1)
    cfg.precision.dtype = dtype
    return gpu_kernels(cfg, hardware.peak_tflops("h100_sxm", dtype) or PEAK)


def tflops(kernels: Kernels, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    return 2 * m * n * k / kernels.gemm(m, n, k, dtype) / 1e12


def test_a_gemm_of_the_best_measured_shape_runs_at_the_measured_rate() -> None:
    """S. Bekman, "Machine Learning Engineering", Maximum Achievable Matmul FLOPS table:
    H100 SXM 794.5 TFLOP/s in BF16 at 2048x2048x13312 and 1402.6 in FP8 at
    1024x9216x14336; A100 SXM 271.2 at 1024x10240x5120."""
    assert tflops(h100_kernels(), 2048, 2048, 13312) == pytest.approx(794.5, rel=1e-3)
    assert tflops(h100_kernels("fp8"), 1024, 9216, 14336, "fp8") == pytest.approx(1402.6, rel=1e-3)
    a100 = recipe(LLAMA3_8B, nodes=1)
    a100.cluster.gpu_type = "a100_sxm_80gb"
    assert tflops(gpu_kernels(a100, 312.0), 1024, 10240, 5120) == pytest.approx(271.2, rel=1e-3)


def test_a_gemm_a_sliver_past_a_full_wave_pays_for_a_second() -> None:
    """Wave quantization (Anthony et al. 2024, "The Case for Co-Designing Model
    Architectures with Hardware", section 4; 132 SMs on H100): 132 tiles of 128 x 256 fill
    one wave; two more tiles' width (1.5% more FLOPs) needs a second, nearly empty, wave,
    and no other tile shape avoids most of its cost."""
    kernels = h100_kernels()
    full, sliver = 256 * 66, 256 * 67
    one_wave = kernels.gemm(256, full, 8192, "bf16")
    assert kernels.gemm(256, sliver, 8192, "bf16") > 1.4 * one_wave


def test_short_reductions_lose_more_to_writing_their_output() -> None:
    """The weak-scaling GPT runs of the Megatron-LM README gain MFU with size "because
    larger GEMMs have higher arithmetic intensity": at one output shape, every tile writes
    its output after its K loop, which a short loop amortizes worst. On H100 the write of a
    tile costs as long as 989.5 / 3.35 = 295 more columns of K."""
    kernels = h100_kernels()
    rates = [tflops(kernels, 8192, 4096, k) for k in (1024, 2048, 8192)]
    assert rates == sorted(rates)
    balance = 989.5 / 3.35
    drain = (1024 / (1024 + balance)) / (8192 / (8192 + balance))
    assert rates[0] / rates[2] == pytest.approx(drain)


def test_attention_runs_at_flashattention_2s_causal_rate() -> None:
    """Dao-AILab/flash-attention README, "Attention forward + backward speed (H100 80GB
    SXM5)", with causal mask, head dimension 128: 294 TFLOP/s at 4K tokens (the causal half
    of the square; backward 2.5 times the forward). A Llama 3 8B block at 4096 tokens spends
    its attention's causal FLOPs x 3.5 at that rate, on its rank's heads."""
    cfg = recipe(LLAMA3_8B, nodes=1, tp=2)
    cfg.train.seq_len = 4096
    degrees_ = degrees(cfg)
    kernels = gpu_kernels(cfg, PEAK)
    work = block_work(cfg.model, False, degrees_, False, 1.0)
    block = block_seconds(kernels, cfg, degrees_, work, 4096, False)
    causal = 2 * (4096 - 4096 / 2) * 32 * (128 + 128) / 2  # per token, 16 heads of 32
    assert block.attention == pytest.approx(4096 * causal * 3.5 / 294e12)


def test_fp8_runs_only_the_blocks_linear_layers_at_the_fp8_rate() -> None:
    """Under precision.dtype=fp8 the blocks' nn.Linear layers compute in FP8
    (parallel/precision.py fp8_candidate); attention and the LM head stay BF16, so their
    seconds do not move while the linears' GEMMs run at the FP8 rate (1402.6 against 794.5
    TFLOP/s at the best shapes), less the casts' memory traffic."""
    bf16, fp8 = recipe(LLAMA3_8B, nodes=1), recipe(LLAMA3_8B, nodes=1)
    fp8.precision.dtype = "fp8"
    d = degrees(bf16)
    blocks = []
    for cfg, peak in ((bf16, PEAK), (fp8, 2 * PEAK)):
        kernels = gpu_kernels(cfg, peak)
        work = block_work(cfg.model, False, d, False, 1.0)
        blocks.append((block_seconds(kernels, cfg, d, work, 4096, False), kernels))
    (plain, k16), (fast, k8) = blocks
    assert fast.attention == plain.attention
    assert head_seconds(k8, fp8, 4096, 1) == head_seconds(k16, bf16, 4096, 1)
    assert 1.3 * fast.forward < plain.forward < 1.77 * fast.forward


def test_hidden_data_parallel_traffic_slows_the_compute_it_overlaps_by_189_per_mille() -> None:
    """Lee et al. 2025 ("Characterizing Compute-Communication Overlap in GPU-Accelerated
    Distributed Deep Learning", arXiv 2507.03114): overlapping computation with
    communication slows the computation by 18.9% on average. Llama 3 8B under ZeRO-3 over
    one node gathers and reduces well inside its compute: all of it is hidden, and 18.9% of
    it is what the step pays."""
    cfg = recipe(LLAMA3_8B, nodes=1, zero=3)
    cfg.train.global_batch = 8 * 4
    cost = step_cost(cfg, degrees(cfg), 4, PEAK, H100)
    assert cost.dp_total < cost.compute
    assert cost.dp_exposed == pytest.approx(OVERLAP_SLOWDOWN * cost.dp_total)
    assert OVERLAP_SLOWDOWN == 0.189


def test_the_optimizer_step_streams_the_ranks_shard_of_the_states_once() -> None:
    """AdamW reads each FP32 parameter, its gradient (twice: the clipping norm and the
    update) and two moments, and writes the parameter, the moments and the BF16 copy: 34
    bytes per parameter at the H100's 3.35 TB/s; ZeRO-1 over 8 ranks updates an eighth."""
    cfg = recipe(LLAMA3_8B, nodes=1)
    kernels = gpu_kernels(cfg, PEAK)
    assert optimizer_seconds(kernels, cfg, 1e9) == pytest.approx(1e9 * 34 / 3.35e12)


def test_zero1_steps_the_states_of_its_dp_shard_share_as_the_trainer_deals_them() -> None:
    """ZeRO-1's owners are dealt over dp_shard (parallel/data_parallel.py
    `build_zero1_optimizer`): under cp=2 on 8 GPUs each of 4 owners steps a quarter of the
    parameters, where FSDP (ZeRO-2) shards them over dp_shard x cp, an eighth."""
    shares = []
    for zero in (1, 2):
        cfg = recipe(LLAMA3_8B, nodes=1, cp=2, zero=zero)
        shares.append(_optimizer_params(cfg, degrees(cfg), 0, count_params(cfg.model)))
    assert shares == pytest.approx(
        [count_params(LLAMA3_8B).total / 4, count_params(LLAMA3_8B).total / 8]
    )


def test_fsdp_issues_a_gather_per_unit_and_pass_and_a_reduction_per_unit_and_step() -> None:
    """The tiny recipe's units are 4 blocks and the root, over 2 accumulation micro-batches:
    ZeRO-3 gathers 5 + 4 per micro-batch and reduce-scatters 5 per step, 23 (torch's
    profiler counts 18 c10d all-gathers and 5 reduce-scatters in one such step on 2 CPU
    ranks); ZeRO-2 gathers once per step, 10; hybrid sharding all-reduces each reduction
    again; a pipeline rank of two chunks has two roots."""

    def calls(*overrides: str) -> int:
        cfg = compose_recipe("tiny", list(overrides))
        return fsdp_calls(cfg, resolve_degrees(cfg), grad_accum_steps(cfg))

    assert calls("parallel.zero=3") == 2 * (5 + 4) + 5
    assert calls("parallel.zero=2") == 5 + 5
    assert calls() == calls("parallel.zero=1") == 0
    hybrid = ["cluster.gpus_per_node=4", "parallel.dp_replicate=2"]
    assert calls("parallel.zero=2", *hybrid) == 5 + 2 * 5
    # pp=2 x vpp=2 over 4 GPUs: each rank one block and a root in each of its two chunks.
    piped = ["cluster.gpus_per_node=4", "parallel.pp=2", "parallel.vpp=2",
             "parallel.pp_schedule=interleaved_1f1b"]  # fmt: skip
    assert calls("parallel.zero=2", *piped) == 4 + 4
