"""The in-place shm path: tensors from ``shm.shared_empty`` above the direct threshold, reduced where they
lie (issue 9, item 5). Every other test's message is at most 256 KB, so only these reach ``_in_place``."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.comm.shm_group import SMALL_BYTES, get_shm_group
from ringtrain.parallel import ManualStrategy
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

# (dtype, elements): each above SMALL_BYTES (256 KB), odd sizes so that shards end unevenly.
LARGE = [("float32", 100_003), ("float64", 70_001), ("float16", 200_003), ("bfloat16", 131_075), ("int32", 65_541), ("int64", 40_009)]


def _values(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def _bound(x: torch.Tensor, world_size: int, op: str) -> torch.Tensor:
    """How far two float sums of the same world_size terms (in other orders) can be apart: twice the
    error bound of each, (world_size + 2) eps sum|x| + world_size smallest normal (avg: divided)."""
    if not x.dtype.is_floating_point:
        return torch.zeros(x.shape, dtype=torch.float64)
    sum_abs = x.double().abs()
    dist.all_reduce(sum_abs)
    info = torch.finfo(x.dtype)
    bound = 2 * ((world_size + 2) * info.eps * sum_abs + world_size * info.smallest_normal)
    return bound / world_size if op == "avg" else bound


def in_place_calls(rank: int, world_size: int) -> list[dict]:
    sg = get_shm_group(dist.group.WORLD)
    shared = {name: shm.shared_empty(numel, getattr(torch, name)) for name, numel in LARGE}
    small_shared = shm.shared_empty(1000)  # in shared memory but below the threshold: the direct path
    reports = []
    for round_index in range(2):  # a second round reuses the arenas (and the flags' parity) after the first
        for case, (name, numel) in enumerate(LARGE):
            dtype = getattr(torch, name)
            for op in ("sum", "avg") if dtype.is_floating_point else ("sum",):
                seed = 1000 * round_index + 10 * case + rank
                x = _values(dtype, numel, seed)
                tensor = shared[name]
                tensor.copy_(x)
                assert tensor.numel() * tensor.element_size() > SMALL_BYTES and sg.find_arena(tensor) is not None
                reference = x.clone()
                if op == "avg":
                    reference.div_(world_size)
                dist.all_reduce(reference)  # torch's answer, the same divide-then-sum
                bound = _bound(x, world_size, op)
                comm.all_reduce(tensor, op=op, algorithm="shm")
                # Small calls in between: the direct path, on plain and shared tensors, then a staged one.
                small = torch.full((777,), float(rank + 1))
                comm.all_reduce(small, algorithm="shm")
                comm.all_reduce(small_shared.fill_(rank + 1), op="avg", algorithm="shm")
                staged = torch.full((100_000,), float(rank))
                comm.all_reduce(staged, algorithm="shm")
                reports.append({
                    "case": f"{name} {op} round {round_index}",
                    "exact": torch.equal(tensor, reference),
                    "differ": (tensor != reference).nonzero().flatten()[:5].tolist(),
                    "close": bool(((tensor.double() - reference.double()).abs() <= bound).all()),
                    "digest": hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest(),
                    "others": (small[0].item(), small_shared[0].item(), staged[0].item()),
                })
    return reports


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_tensors_above_the_threshold_are_reduced_in_place_as_torch_does(world_size):
    per_rank = run_distributed(in_place_calls, world_size, timeout_s=120)
    total = sum(range(1, world_size + 1))
    for position, report in enumerate(per_rank[0]):
        assert len({reports[position]["digest"] for reports in per_rank}) == 1, f"{report['case']}: ranks differ"
        for rank, reports in enumerate(per_rank):
            ours = reports[position]
            # Integers at any size, floats at two ranks: torch's bits. Floats at three: the same within rounding.
            exact = world_size == 2 or not report["case"].startswith(("float", "bfloat"))
            assert ours["exact"] if exact else ours["close"], f"rank {rank}, {ours['case']}, differ at {ours['differ']}"
            assert ours["others"] == (total, total / world_size, sum(range(world_size))), f"rank {rank}, {ours['case']}"


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 640 KB and 160 KB of gradients: with bucket_mb=0.5 one bucket of 0.64 MB (in place), one of 0.16 MB (direct).
    return nn.Sequential(nn.Linear(320, 500), nn.ReLU(), nn.Linear(500, 80), nn.ReLU(), nn.Linear(80, 3))


def manual_shm(rank: int, world_size: int) -> dict:
    results = {}
    for algorithm in ("torch", "shm"):
        strategy = ManualStrategy(torch.device("cpu"), bucket_mb=0.5, algorithm=algorithm)
        model = strategy.wrap(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(16, 320, generator=g), torch.randint(0, 3, (16,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep .grad the bucket's view: the in-place path again
        module = strategy.unwrap(model)
        if algorithm == "shm":
            sg = get_shm_group(dist.group.WORLD)
            sizes = [b.flat.numel() * b.flat.element_size() for b in model._buckets]
            results["in_place_buckets"] = sum(size > SMALL_BYTES and sg.find_arena(b.flat) is not None
                                             for size, b in zip(sizes, model._buckets))
        results[algorithm] = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return results


def test_the_manual_strategy_with_buckets_above_the_threshold_matches_torch():
    # Two ranks: each bucket average is (a / 2) + (b / 2) whoever adds it, so the weights agree bit for bit.
    for result in run_distributed(manual_shm, 2, timeout_s=120):
        assert result["in_place_buckets"] >= 1
        assert torch.equal(result["shm"], result["torch"])
