"""PowerSGD over Gloo with several gradient buckets, as ringtrain's trainer runs it (an async all-reduce of
the step's flags issued just before the backward).

torch's PowerSGD hook issues its second and third all-reduce of a bucket from the callback of the first,
which on Gloo runs on a Gloo thread when that all-reduce completes, while the backward goes on issuing the
next bucket's: two ranks could issue them in different orders, a collective mismatch that aborts the
process (``op.preamble.length <= op.nbytes``). ringtrain's ``powersgd`` waits for each bucket on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringtrain.comm.hooks import register_comm_hook
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

STEPS = 6


def train(rank: int, world_size: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    # Buckets of about one layer each: eight hooks per backward.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.07)
    register_comm_hook(ddp, "powersgd", powersgd_start_iter=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    for _ in range(STEPS):
        flags = torch.zeros(2)
        work = dist.all_reduce(flags, async_op=True)  # the trainer's step agreement, beside the backward
        ddp(torch.randn(16, 128)).square().sum().backward()
        work.wait()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_powersgd_with_many_buckets_keeps_the_ranks_in_step():
    weights = run_distributed(train, 2, timeout_s=120)
    assert torch.equal(weights[0], weights[1])
