"""The stability monitors on a tiny model in one process, against values computed by hand
from the model's weights and its forward written out; and the alert of an injected spike."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.core.model_config import ModelConfig
from pretrain.models import build
from pretrain.models.layers import max_logit
from pretrain.models.rope import apply_rope
from pretrain.trainer.observe.activation_probes import ActivationProbes
from pretrain.trainer.observe.layer_norms import group_of
from pretrain.trainer.observe.stability import StabilityMonitor
from pretrain.trainer.step.phases import StepPhases

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                  max_seq_len=16)  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build(CFG).to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _monitor(model: torch.nn.Module, thresholds: dict[str, float]) -> StabilityMonitor:
    phases = StepPhases(torch.device("cpu"))
    probes = ActivationProbes([model], CFG.n_layers, tp=1, sp=False, tp_group=None,
                              device=torch.device("cpu"), phases=phases)  # fmt: skip
    return StabilityMonitor(1, thresholds, probes, n_layers=CFG.n_layers, stage_ranks=1,
                            device=torch.device("cpu"), phases=phases)  # fmt: skip


def _sampled_step(model, monitor, batches, lr: float = 0.01) -> dict:
    """One optimizer step over `batches` (accumulated) with the monitors armed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor.arm(1)
    for tokens in batches:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    monitor.gradients(model)
    with monitor.update(model, applied=True):
        optimizer.step()
    return monitor.collect(1)


def _by_hand(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, list[float]]:
    """Block output RMS, largest causal attention logit per layer and z-mean, from the
    forward written out over every batch."""
    squares = [0.0] * CFG.n_layers
    count = [0] * CFG.n_layers
    logit = [-math.inf] * CFG.n_layers
    z, tokens_seen = 0.0, 0
    with torch.no_grad():
        for tokens in batches:
            x = tokens[:, :-1]
            s = x.shape[1]
            cos, sin = model.rope_cos[:s], model.rope_sin[:s]
            h = model.tok_embeddings(x)
            for i, block in enumerate(model.layers.values()):
                a = block.attention
                n = block.attention_norm(h)
                q = apply_rope(a.wq(n).view(*x.shape, -1, CFG.head_dim), cos, sin)
                k = apply_rope(a.wk(n).view(*x.shape, -1, CFG.head_dim), cos, sin)
                k = k.repeat_interleave(CFG.n_heads // CFG.kv_heads, dim=2)
                scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(CFG.head_dim)
                causal = torch.ones(s, s, dtype=torch.bool).tril()
                logit[i] = max(logit[i], scores.masked_fill(~causal, -math.inf).max().item())
                h = block(h, cos, sin)
                squares[i] += h.pow(2).sum().item()
                count[i] += h.numel()
            lse = torch.logsumexp(model.output(model.norm(h)), dim=-1)
            z += lse.pow(2).sum().item()
            tokens_seen += lse.numel()
    rms = [math.sqrt(q / c) for q, c in zip(squares, count, strict=True)]
    return {"act_rms": rms, "attn_logit": logit, "z_mean": [z / tokens_seen]}


def test_sampled_monitors_match_a_hand_computation(single_rank_group) -> None:
    model = _model()
    torch.manual_seed(1)
    batches = [torch.randint(0, CFG.vocab_size, (2, 13)) for _ in range(2)]
    expected = _by_hand(model, batches)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = _sampled_step(model, _monitor(model, {}), batches)

    groups: dict[str, dict[str, float]] = {}
    for name, p in model.named_parameters():
        g = groups.setdefault(group_of(name), {"grad": 0.0, "param": 0.0, "change": 0.0})
        g["grad"] += p.grad.pow(2).sum().item()
        g["param"] += before[name].pow(2).sum().item()
        g["change"] += (p.detach() - before[name]).pow(2).sum().item()
    assert set(groups) == {"embed", "layer_0", "layer_1", "head"}
    for group, sums in groups.items():
        assert metrics[f"stability/grad_norm/{group}"] == pytest.approx(math.sqrt(sums["grad"]))
        assert metrics[f"stability/param_norm/{group}"] == pytest.approx(math.sqrt(sums["param"]))
        ratio = math.sqrt(sums["change"] / sums["param"])
        assert metrics[f"stability/update_ratio/{group}"] == pytest.approx(ratio, rel=1e-4)
    whole = math.sqrt(sum(g["grad"] for g in groups.values()))
    assert metrics["stability/grad_norm_max"] < whole  # each layer is a part of the whole
    for i in range(CFG.n_layers):
        rms, logit = expected["act_rms"][i], expected["attn_logit"][i]
        assert metrics[f"stability/act_rms/layer_{i}"] == pytest.approx(rms, rel=1e-5)
        assert metrics[f"stability/attn_logit/layer_{i}"] == pytest.approx(logit, rel=1e-5)
    assert metrics["stability/attn_logit_max"] == pytest.approx(max(expected["attn_logit"]))
    assert metrics["stability/z_mean"] == pytest.approx(expected["z_mean"][0], rel=1e-5)


def test_an_unsampled_step_measures_nothing() -> None:
    model = _model()
    monitor = _monitor(model, {})
    monitor.every = 2
    monitor.arm(1)
    model(torch.randint(0, CFG.vocab_size, (1, 8)))
    assert not monitor.active and monitor.collect(1) == {}


def test_the_max_logit_honours_a_boolean_mask() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 3, 1] = True  # one allowed pair
    expected = (q[0, :, 3] @ k[0, 0, 1]).max() * 0.5
    assert max_logit(q, k, mask, 0.5) == pytest.approx(expected.item())


def test_an_injected_attention_spike_raises_an_alert_and_a_normal_step_none(
    single_rank_group,
) -> None:
    batches = [torch.randint(0, CFG.vocab_size, (2, 13))]
    model = _model()
    monitor = _monitor(model, {"attn_logit_max": 100.0, "update_ratio_max": 0.0})
    normal = _sampled_step(model, monitor, batches)
    assert normal["stability/attn_logit_max"] < 100 and monitor.alerts == []
    with torch.no_grad():  # the spike: one layer's queries and keys 30 times larger
        model.layers["1"].attention.wq.weight.mul_(30)
        model.layers["1"].attention.wk.weight.mul_(30)
    spiked = _sampled_step(model, monitor, batches)
    [alert] = monitor.alerts
    assert alert.name == "attn_logit_max" and alert.value == spiked["stability/attn_logit_max"]
    assert alert.value > 100 and monitor.latest["attn_logit_max"] == alert.value
    assert "stability/attn_logit_max" in alert.line() and "above its threshold 100" in alert.line()
