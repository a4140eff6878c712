"""What keeps a model from being written in the Hugging Face format of its family (no torch):
`pretrain export` refuses it with these reasons, and validation refuses
`checkpoint.hf_every` with them before a job starts."""

from __future__ import annotations

from pretrain.core.hf.llama import FAMILIES, family
from pretrain.core.hf.moe import export_problems
from pretrain.core.model_config import ModelConfig


def export_refusal(m: ModelConfig, groups: int) -> str | None:
    """Why no Hugging Face family this exporter writes holds the model, as the rest of a
    sentence whose subject is the run ("cannot be exported ..."); None: `family(m)` holds it.
    `groups`: the expert groups its router limits each token to (1 without a limit)."""
    reason = _layer_refusal(m)
    if reason is not None:
        return f"cannot be exported: {reason}"
    problems = export_problems(m, groups)
    if problems:
        return f"cannot be exported as a Hugging Face {FAMILIES[family(m)]}:\n" + "\n".join(
            problems
        )
    return None


def _layer_refusal(m: ModelConfig) -> str | None:
    if m.mlp != "swiglu":
        return (
            f"model.mlp={m.mlp}: Llama's and Mixtral's MLPs are SwiGLU (gate, up and down "
            "projections), so a one-input MLP has no place there; this run's checkpoints can "
            "be resumed but not exported"
        )
    if m.qk_norm and m.attn_bias:
        return (
            "model.qk_norm=true with model.attn_bias=true: Qwen3 (the family with query/key "
            "norms) puts a bias on the output projection too when it has biases, and Qwen2 "
            "has no norms; export a model trained with one of the two"
        )
    if m.sliding_window and not m.moe_experts and (m.qk_norm or m.attn_bias):
        return (
            f"model.sliding_window={m.sliding_window} with Qwen's attention options: Mistral "
            "(the family with one window on every layer) has neither biases nor query/key "
            "norms; export a model trained without one or the other"
        )
    return None
