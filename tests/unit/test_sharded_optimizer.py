"""ZeRO-1's sharded optimizer (parallel/zero/sharded_optimizer.py) in one process: how it
deals the parameters out, and that it steps as the optimizer it wraps. Its sharding over
tp, pp, ep and dp ranks is trained in tests/distributed/test_pairwise_matrix.py and resumed
in tests/distributed/test_checkpoint_resume.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pretrain.parallel.zero.sharded_optimizer import ShardedOptimizer, deal_owners


def test_the_largest_parameters_go_first_each_to_the_least_loaded_rank() -> None:
    # 40 to the first rank, 30 to the second, 20 to the second (30 < 40), 10 to the first.
    assert deal_owners([10, 40, 30, 20], ranks=2) == [0, 0, 1, 1]
    assert deal_owners([5, 5, 5], ranks=4) == [0, 1, 2]
    shares = [0, 0, 0]
    sizes = [64, 64, 8, 8, 8, 8, 192, 192, 192]
    for size, owner in zip(sizes, deal_owners(sizes, ranks=3), strict=True):
        shares[owner] += size
    # The three 192s one each, the 64s to the first two, the 8s to the third.
    assert shares == [256, 256, 224]


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_rank_steps_as_the_wrapped_optimizer_with_the_full_groups_learning_rate(
    one_rank_group,
) -> None:
    torch.manual_seed(0)
    plain, sharded = nn.Linear(8, 4), nn.Linear(8, 4)
    sharded.load_state_dict(plain.state_dict())
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    reference = torch.optim.AdamW(plain.parameters(), **kwargs)
    optimizer = ShardedOptimizer(
        [{"params": list(sharded.parameters())}],
        torch.optim.AdamW,
        kwargs,
        group_of=lambda _: one_rank_group,
    )
    x = torch.randn(16, 8)
    for step in range(3):
        # A schedule sets the full groups' lr; the owned optimizer must follow.
        for groups in (reference.param_groups, optimizer.param_groups):
            groups[0]["lr"] = 1e-2 / (step + 1)
        for model, opt in ((plain, reference), (sharded, optimizer)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(plain.parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert optimizer.optim.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
