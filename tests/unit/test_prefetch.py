"""The prefetching loader: the same batches as the plain loader, and an exact position."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from pretrain.trainer.data.dataset import PackedSequences, TokenStream
from pretrain.trainer.data.loader import DataLoader, open_datasets
from pretrain.trainer.data.prefetch import PrefetchingLoader
from pretrain.trainer.data.sampler import MixtureSampler
from tests.helpers import data_recipe

SEQ_LEN = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> PackedSequences:
    """A token file of 0, 1, 2, ... (every sequence distinct), 50 sequences of 8 tokens."""
    folder = tmp_path_factory.mktemp("tokens")
    np.arange(50 * SEQ_LEN + 1, dtype=np.uint16).tofile(folder / "train.bin")
    cfg = data_recipe(str(folder / "train.bin"), folder / "cache", "none")
    [prepared] = open_datasets(cfg, is_main=True, report=lambda _: None)
    return PackedSequences(TokenStream(prepared, prepared.everything()), SEQ_LEN)


def loader(dataset: PackedSequences, global_batch: int, dp_rank: int = 1) -> DataLoader:
    sampler = MixtureSampler([len(dataset)], [1.0], global_batch=global_batch, seed=7)
    return DataLoader([dataset], sampler, dp_rank=dp_rank, dp_size=2, micro_batch=3)


def plain_loader(dataset: PackedSequences, dp_rank: int = 1) -> DataLoader:
    # 12 sequences per step over 2 ranks in micro-batches of 3: two micro-batches per rank.
    return loader(dataset, 12, dp_rank)


def as_lists(step: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list, list]]:
    return [(inputs.tolist(), targets.tolist()) for inputs, targets in step]


def test_prefetching_yields_exactly_the_plain_loaders_batches_across_epochs(dataset):
    steps = 12  # 144 sequences: almost three epochs of 50
    plain = plain_loader(dataset)
    expected = [as_lists(plain.next_step()) for _ in range(steps)]
    prefetching = PrefetchingLoader(plain_loader(dataset), depth=3)
    assert [as_lists(prefetching.next_step()) for _ in range(steps)] == expected
    prefetching.close()


def test_state_is_the_next_step_consumed_not_what_the_thread_read_ahead(dataset):
    prefetching = PrefetchingLoader(plain_loader(dataset), depth=4)
    for _ in range(3):
        prefetching.next_step()
    # Let the thread fill its queue: the underlying loader is then steps ahead of the loop.
    deadline = time.monotonic() + 30
    while prefetching.loader.step < 3 + 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetching.loader.step > 3
    state = json.loads(json.dumps(prefetching.state_dict()))  # as a checkpoint stores it
    assert state["step"] == prefetching.step == 3
    expected = [as_lists(prefetching.next_step()) for _ in range(4)]
    prefetching.close()

    resumed_plain = plain_loader(dataset)
    resumed_plain.load_state_dict(state)
    assert [as_lists(resumed_plain.next_step()) for _ in range(4)] == expected

    resumed = PrefetchingLoader(plain_loader(dataset), depth=2)
    resumed.next_step()  # its thread is already reading from step 0 when the state arrives
    resumed.load_state_dict(state)
    assert [as_lists(resumed.next_step()) for _ in range(4)] == expected
    resumed.close()


def test_close_leaves_the_underlying_loader_at_the_consumed_position(dataset):
    prefetching = PrefetchingLoader(plain_loader(dataset), depth=2)
    prefetching.next_step()
    prefetching.next_step()
    prefetching.close()
    assert prefetching.loader.step == 2
    assert prefetching.state_dict() == prefetching.loader.state_dict()


def test_a_read_error_reaches_the_loop_with_its_step(dataset):
    # A global batch of 10 cannot be split over 2 ranks x micro-batch 3: the first read fails.
    prefetching = PrefetchingLoader(loader(dataset, 10, dp_rank=0), depth=2)
    with pytest.raises(RuntimeError, match="step 0 failed") as error:
        prefetching.next_step()
    assert "not divisible" in str(error.value.__cause__)
    prefetching.close()


def test_depth_below_one_is_refused(dataset):
    with pytest.raises(ValueError, match="depth must be >= 1"):
        PrefetchingLoader(plain_loader(dataset), depth=0)
