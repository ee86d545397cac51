"""The pipelined hierarchical all-reduce (shared memory inside a host, the leaders' ring on a thread of
their own, piece by piece) against torch's, on ranks declared to be on two hosts; pieces made small so that
small tensors take the pipelined path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm import hierarchical, shm
from tests.distributed import run_distributed

SIZES = [1, 1023, 1024, 5 * 1024 + 7, 40_000]


def pipelined(rank: int, world_size: int, hosts: list[str]) -> list[tuple[int, str, bool, bool]]:
    shm.init_shm(hosts=hosts)
    hierarchical.PIPELINE_PIECE_BYTES = 4096  # 1024 float32 elements a piece
    results = []
    for numel in SIZES:
        for op in ("sum", "avg"):
            # Whole numbers (and multiples of the world size): every sum exact, every order the same bits.
            x = torch.arange(numel, dtype=torch.float32).remainder(97).mul(world_size * (rank + 1))
            reference = x.clone()
            dist.all_reduce(reference)
            if op == "avg":
                reference.div_(world_size)
            y = x.clone()
            comm.all_reduce(y, op=op, algorithm="shm")
            gathered = [torch.empty_like(y) for _ in range(world_size)]
            dist.all_gather(gathered, y)
            results.append((numel, op, torch.equal(y, reference), all(torch.equal(g, y) for g in gathered)))
    return results


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "b"]], ids=["2x2", "1+2"])
def test_pipelined_hierarchical_all_reduce_is_exact_in_pieces(hosts):
    for per_rank in run_distributed(pipelined, len(hosts), hosts, timeout_s=120):
        for numel, op, equal, agreed in per_rank:
            assert equal and agreed, (numel, op, equal, agreed)
