"""The memory model against Megatron-LM's theoretical memory (`tests/megatron_memory.py`,
re-derived from NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553) for three layouts:

- Llama 3 70B as `recipes/llama3_70b.yaml` runs it: TP8 SP PP4 1F1B, ZeRO-2 over dp=2;
- GPT-3 175B (tied embeddings) Megatron-style: TP8 SP PP16 interleaved with vpp=2, ZeRO-2
  over dp=8;
- Llama 3 8B on one node of 8: data parallel only, under ZeRO-1 and ZeRO-0.

Where this trainer allocates as Megatron does, the figures agree within 2%: ZeRO-2's FP32
shards, unsharded FP32 gradients and BF16 parameter copies are Megatron's distributed
optimizer (6 + 12/dp bytes per parameter), and the first stage holds the same micro-batches
in flight. Where it allocates differently, each test names the difference and its size.
"""

from __future__ import annotations

import pytest

from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.plan.memory import in_flight, llama_block_activations, memory_breakdown
from pretrain.launcher.validate.recipe import validate
from tests import megatron_memory as megatron
from tests.helpers import GPT3_175B, LLAMA3_8B, LLAMA3_70B
from tests.megatron_memory import MegatronLayout


def recipe(model, nodes, tp, pp, vpp, zero, global_batch, seq_len) -> RecipeConfig:
    """BF16 on H100 nodes of 8, SP with TP, selective recompute, micro-batch 1."""
    cfg = RecipeConfig(name="megatron", model=model)
    cfg.precision.dtype, cfg.recompute.policy = "bf16", "selective"
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = nodes, 8
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = seq_len, 1, global_batch
    p = cfg.parallel
    p.tp, p.sp, p.pp, p.vpp, p.zero = tp, tp > 1, pp, vpp, zero
    p.pp_schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    validate(cfg)
    return cfg


PIPELINED = {
    "llama3_70b_tp8_pp4": (
        recipe(LLAMA3_70B, 8, 8, 4, 1, 2, 256, 8192),
        MegatronLayout(tp=8, pp=4, dp=2),
    ),
    "gpt3_175b_tp8_pp16_vpp2": (
        recipe(GPT3_175B, 128, 8, 16, 2, 2, 1536, 2048),
        MegatronLayout(tp=8, pp=16, dp=8, vpp=2),
    ),
}


def first_stage(cfg: RecipeConfig):
    """The breakdown of pipeline rank 0 (Megatron's estimate is of the first stage)."""
    breakdown = memory_breakdown(cfg, resolve_degrees(cfg), grad_accum_steps(cfg), 0)
    assert breakdown.peak_phase == "forward"
    return breakdown


def model_states(breakdown) -> float:
    """Weights, gradients and optimizer states, with FSDP's or autocast's BF16 copies."""
    return breakdown.params + breakdown.grads + breakdown.optimizer + breakdown.transients


@pytest.mark.parametrize("case", PIPELINED)
def test_zero2_model_states_are_megatrons_distributed_optimizer_within_2_percent(case):
    cfg, layout = PIPELINED[case]
    ours, theirs = model_states(first_stage(cfg)), megatron.weight_and_optimizer(cfg.model, layout)
    assert ours == pytest.approx(theirs, rel=0.02)
    assert megatron.bytes_per_param(layout) == 6 + 12 / layout.dp


@pytest.mark.parametrize("case", PIPELINED)
def test_the_first_stage_holds_megatrons_micro_batches_in_flight(case):
    """1F1B: pp; interleaved: pp (1 + (pp-1)/(pp vpp)) = 16 + 7.5 for GPT-3 175B."""
    cfg, layout = PIPELINED[case]
    p, micro = cfg.parallel, grad_accum_steps(cfg)
    ours = in_flight(p.pp_schedule, p.pp, micro, p.vpp, 0)
    assert ours == megatron.in_flight(layout, micro) == {4: 4, 16: 23.5}[p.pp]


@pytest.mark.parametrize("case", PIPELINED)
def test_activations_differ_from_megatrons_by_the_named_terms(case):
    """Megatron keeps sbh(18 + 4 ffn/h)/t per layer (selective recompute of the attention
    core only, with dropout); this trainer's selective recompute keeps only the block input
    and the matmul outputs: sb(2h + 2(q + 2kv) + 4 ffn + 4h)/t, which is 184,320/262,144 =
    0.703 of it for Llama 3 70B and 68/86 = 0.791 for GPT-3 175B (ffn = 8h/3, kv = q = h).
    Beside the layers, this trainer counts the stage's output (2sbh/t per micro-batch, held
    for the next stage's backward) and, at the peak of backward, one block recomputed whole
    with its MLP's gradient temporaries (sb(2h + 6 ffn)/t); Megatron counts the embedding's
    token ids and dropout mask ((8sb + sbh)/t per micro-batch), which this model, without
    dropout, leaves out."""
    cfg, layout = PIPELINED[case]
    m, p, s = cfg.model, cfg.parallel, cfg.train.seq_len
    t, micro, h, f = p.tp, grad_accum_steps(cfg), m.dim, m.ffn_dim
    flight, layers = megatron.in_flight(layout, micro), m.n_layers / p.pp
    ours_layer = llama_block_activations(m, s, 1, 2, 2, t, True, "selective")
    theirs_layer = megatron.layer_activations(m, s, 1, t)
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    assert ours_layer == s * (2 * h + 2 * (q + 2 * kv) + 4 * f + 4 * h) / t
    ratio = {4: 0.703, 16: 0.791}[p.pp]
    assert ours_layer / theirs_layer == pytest.approx(ratio, abs=0.001)
    named = {
        "matmul outputs kept, not the attention core recomputed": (
            flight * layers * (ours_layer - theirs_layer)
        ),
        "the stage's output": flight * s * 2 * h / t,
        "one block recomputed in backward": (
            llama_block_activations(m, s, 1, 2, 2, t, True, "none") + s * (2 * h + 6 * f) / t
        ),
        "Megatron's embedding ids and dropout mask": -megatron.embedding_activations(
            m, s, 1, layout, micro
        ),
    }
    theirs = megatron.activations(m, s, 1, layout, micro)
    assert first_stage(cfg).activations == pytest.approx(theirs + sum(named.values()), rel=0.02)


@pytest.mark.parametrize(
    ("zero", "distributed", "extra"),
    [
        # FP32 master weights replicated (4 B where Megatron keeps 4/dp), DDP's FP32 bucket
        # buffers (4 B) and the extra gradient buffer of DDP's synced backward after no-sync
        # micro-batches (4 B, measured on CPU): 4 (1 - 1/8) + 4 + 4 = 11.5 B per parameter.
        (1, True, 4 * (1 - 1 / 8) + 4 + 4),
        # Against Megatron without the distributed optimizer (18 B): the two DDP buffers.
        (0, False, 4 + 4),
    ],
)
def test_ddp_and_zero1_hold_the_named_extra_bytes_per_parameter(zero, distributed, extra):
    """Llama 3 8B, dp=8 on one node: Megatron's 6 + 12/8 = 7.5 B per parameter with the
    distributed optimizer, 18 B without; this trainer's ZeRO-1 holds 19 B, ZeRO-0 26 B."""
    cfg = recipe(LLAMA3_8B, 1, 1, 1, 1, zero, 64, 8192)
    layout = MegatronLayout(tp=1, pp=1, dp=8, distributed_optimizer=distributed)
    params = megatron.most_loaded_params(cfg.model, layout)
    ours = model_states(first_stage(cfg))
    theirs = megatron.weight_and_optimizer(cfg.model, layout)
    assert ours == pytest.approx(theirs + extra * params, rel=0.02)
    assert ours / params == pytest.approx({1: 19, 0: 26}[zero], rel=0.001)
