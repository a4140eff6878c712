"""The model's weights as a checkpoint holds them: keyed by the plain model's parameter names
under any layout (DTensor shards, pipeline stages), so that a checkpoint reshards on load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from pretrain.parallel.pipeline.tied_embedding import (
    EMBEDDING,
    HEAD,
    reads_copy_from_embedding,
    renamed,
)


class ModelState:
    """A Stateful over the module `model()` returns (asked anew each time: PipeDream-2BW
    swaps its weight versions), whose names are the full model's."""

    def __init__(self, model: Callable[[], nn.Module]) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model())

    def state_dict_for_load(self) -> dict[str, Any]:
        """The tensors a load fills, under the names the checkpoint holds them by: a stage's
        copy of a tied embedding reads the embedding's."""
        entries = get_model_state_dict(self.model())
        return renamed(entries, HEAD, EMBEDDING) if self._reads_copy() else entries

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        entries = renamed(state_dict, EMBEDDING, HEAD) if self._reads_copy() else state_dict
        set_model_state_dict(self.model(), entries)

    def _reads_copy(self) -> bool:
        return reads_copy_from_embedding(self.model())


class StashState:
    """PipeDream-2BW's older weight version (the module `stash()` returns), saved beside the
    model's newest; a checkpoint without one (saved under another schedule) gives it the
    model's weights, so that both versions resume from them."""

    def __init__(self, stash: Callable[[], nn.Module], model: Callable[[], nn.Module]) -> None:
        self.stash = stash
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.stash())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.stash(), state_dict)

    def load_absent(self) -> None:
        """The checkpoint holds no stash: copy the (restored) model's weights."""
        set_model_state_dict(self.stash(), get_model_state_dict(self.model()))
