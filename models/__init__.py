"""Plain single-device GPT models (Llama-style) and their exact size and FLOPs math.

Importing this package is cheap: the torch modules load only when `build` is called,
so the launcher can use the pure helpers (`config`, `flops`) on a login node.
"""

from pretrain.core.model_config import ModelConfig

__all__ = ["ModelConfig", "build"]


def build(cfg: ModelConfig):
    """Build the model described by `cfg` on the meta device (no memory, no init)."""
    from pretrain.models.llama import build_on_meta

    return build_on_meta(cfg)
