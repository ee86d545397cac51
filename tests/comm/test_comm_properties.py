"""Property tests: ringtrain's collectives against torch.distributed.all_reduce, at world sizes 1 to 5.

Hypothesis draws a list of cases (size, dtype, op, memory layout, data seed, which algorithms) and one
process group runs all of them, so an example costs one group start, not one per case. What holds, and is
checked, exactly:

- every rank holds the same bits (ranks return a digest of every result), always;
- torch's bits for integers at any world size, and for float sum and avg at world sizes 1 and 2 (two addends
  commute, and avg halves each before the sum, as the reference does);
- for floats at three ranks or more (other summation orders): within the error bound of a sum of
  ``world_size`` terms of the exact sum, and within twice that of torch's result;
- memory outside a strided view untouched.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ringtrain import comm
from ringtrain.comm import shm
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

ALGORITHMS = ("ring", "ring_chunked", "shm")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
EDGE_SIZES = (0, 1, 2, 3, 5, 7, 13, 16, 17, 31, 97, 1009, 65535, 65536, 65537, 131073, 262147, 1048583)
"""Empty, single, fewer than ranks, primes, around the shm small-message limit and the staging piece."""


@st.composite
def cases(draw) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    floating = dtype.startswith(("float", "bfloat"))
    return {
        "numel": draw(st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 40_000))),
        "dtype": dtype,
        "op": draw(st.sampled_from(("sum", "avg"))) if floating else "sum",
        "layout": draw(st.sampled_from(("contiguous", "strided", "offset"))),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "chunk_kb": draw(st.sampled_from((1, 4, 64))),
        # reduce_scatter by one algorithm, all_gather by another: the shard cut must be the same for all.
        "halves": draw(st.tuples(st.sampled_from(("torch", *ALGORITHMS)), st.sampled_from(("torch", *ALGORITHMS)))),
    }


def _input(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor to reduce, the storage it lives in): contiguous, every other element, or misaligned."""
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(case["seed"] * 7 + rank)
    n = case["numel"]
    if dtype.is_floating_point:
        values = torch.randn(2 * n + 1, generator=g, dtype=torch.float64) * 4
    else:
        values = torch.randint(-1000, 1000, (2 * n + 1,), generator=g, dtype=torch.float64)
    base = values.to(dtype)
    view = {"contiguous": base[:n], "strided": base[: 2 * n : 2], "offset": base[1 : n + 1]}[case["layout"]]
    return view, base


def _tolerance(dtype: torch.dtype, sum_abs: torch.Tensor, world_size: int) -> torch.Tensor:
    """Error bound of a sum of world_size terms (plus the division of avg), in the tensor's dtype."""
    if not dtype.is_floating_point:
        return torch.zeros_like(sum_abs)
    info = torch.finfo(dtype)
    return (world_size + 2) * info.eps * sum_abs + world_size * info.smallest_normal


def _bit_for_bit(dtype: torch.dtype, world_size: int) -> bool:
    """Where ringtrain's result must be torch's to the bit: integers always, floats with at most two addends."""
    return not dtype.is_floating_point or world_size <= 2


def check_cases(rank: int, world_size: int, case_list: list[dict], hosts: list[str] | None = None) -> list[dict]:
    if hosts is not None:  # shm across pretend hosts: shared memory within each, a ring between leaders
        shm.init_shm(hosts=hosts)
    reports = []
    for index, case in enumerate(case_list):
        x, _ = _input(case, rank)
        dtype = x.dtype
        exact = x.to(torch.float64, copy=True)  # copy: for float64 .to() would alias x
        dist.all_reduce(exact)
        sum_abs = x.to(torch.float64).abs()
        dist.all_reduce(sum_abs)
        if case["op"] == "avg":
            exact, sum_abs = exact / world_size, sum_abs / world_size
        tol = _tolerance(dtype, sum_abs, world_size)
        reference = x.clone()
        if case["op"] == "avg":
            reference.div_(world_size)
        dist.all_reduce(reference)  # torch's own answer, in the tensor's dtype
        runs = [(algorithm, "all_reduce") for algorithm in case.get("algorithms", ALGORITHMS)] + [(case["halves"], "halves")]
        for algorithm, how in runs:
            y, base = _input(case, rank)
            untouched = base.clone()
            if how == "all_reduce":
                chunk_kb = case["chunk_kb"] if algorithm == "ring_chunked" else None
                returned = comm.all_reduce(y, op=case["op"], algorithm=algorithm, chunk_kb=chunk_kb)
                problem = None if returned is y else "did not return its input"
            else:
                y = y.contiguous()
                base = untouched = None
                comm.reduce_scatter(y, op=case["op"], algorithm=algorithm[0])
                comm.all_gather(y, algorithm=algorithm[1])
                problem = None
            error = (y.to(torch.float64) - exact).abs()
            if problem is None and (error > tol).any():
                worst = int(error.argmax())
                problem = f"element {worst}: {y[worst].item()} vs exact {exact[worst].item()} (bound {tol[worst].item():.3g})"
            if problem is None and ((y.to(torch.float64) - reference.to(torch.float64)).abs() > 2 * tol).any():
                problem = "differs from torch.distributed.all_reduce beyond the bound"
            if problem is None and _bit_for_bit(dtype, world_size) and not torch.equal(y, reference):
                worst = int((y != reference).nonzero()[0])
                problem = f"element {worst}: {y[worst].item()!r} vs torch's {reference[worst].item()!r}, not bit for bit"
            if problem is None and base is not None and case["layout"] == "strided":
                mask = torch.ones_like(base, dtype=torch.bool)
                mask[: 2 * case["numel"] : 2] = False
                if not torch.equal(base[mask], untouched[mask]):
                    problem = "wrote outside the strided view"
            digest = hashlib.sha256(y.clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy().tobytes()).hexdigest()
            reports.append({"case": index, "algorithm": algorithm, "problem": problem, "digest": digest})
    return reports


def _check(world_size: int, case_list: list[dict], hosts: list[str] | None = None) -> None:
    per_rank = run_distributed(check_cases, world_size, case_list, hosts, timeout_s=240)
    for rank, reports in enumerate(per_rank):
        for report in reports:
            assert report["problem"] is None, f"rank {rank}, {report['algorithm']}, {case_list[report['case']]}: {report['problem']}"
    for position, report in enumerate(per_rank[0]):
        digests = {reports[position]["digest"] for reports in per_rank}
        assert len(digests) == 1, f"{report['algorithm']}, {case_list[report['case']]}: ranks hold different bits"


# Each example starts a process group (about a second), so few examples of many cases each. No shrinking:
# it would start dozens of groups, and the failure message already names the failing case.
PROPERTY = settings(
    max_examples=3,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@PROPERTY
@given(case_list=st.lists(cases(), min_size=16, max_size=24))
def test_collectives_match_torch_and_agree_bit_for_bit(world_size, case_list):
    _check(world_size, case_list)


@settings(PROPERTY, max_examples=1)
@given(case_list=st.lists(cases(), min_size=10, max_size=12))
def test_collectives_at_five_ranks(case_list):
    _check(5, case_list)


# More than one ring.MAX_MESSAGE_BYTES (4 MB) piece per half, an odd size: the pieces of the two-host
# exchange stream and finish out of step with each other.
_SEVERAL_PIECES = {"numel": 2_100_001, "dtype": "float32", "op": "avg", "layout": "offset", "seed": 7,
                   "chunk_kb": 1024, "halves": ("shm", "shm"), "algorithms": ("shm",)}


# 2x2: the two-host exchange; 1+2+1: a ring between three leaders, two of them alone on their host.
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "b", "c"]], ids=["2x2", "1+2+1"])
@settings(PROPERTY, max_examples=2)
@given(case_list=st.lists(cases(), min_size=10, max_size=14))
def test_shm_across_hosts_is_hierarchical_and_still_exact(hosts, case_list):
    pieces = [_SEVERAL_PIECES] if len(set(hosts)) == 2 else []  # the two-host exchange's pieces; the ring has none
    _check(len(hosts), [*case_list, *pieces], hosts)


def avg_of_large_halves(rank: int, world_size: int) -> dict:
    results = {}
    for algorithm in ("torch", *ALGORITHMS):
        t = torch.full((1000,), 30000.0, dtype=torch.float16)
        comm.all_reduce(t, op="avg", algorithm=algorithm)
        results[algorithm] = t
    return results


def test_avg_divides_before_summing_so_float16_does_not_overflow():
    # 4 x 30000 overflows float16 (max 65504); the average does not, if each rank divides first.
    for results in run_distributed(avg_of_large_halves, 4):
        for algorithm, t in results.items():
            assert torch.equal(t, torch.full((1000,), 30000.0, dtype=torch.float16)), algorithm


def expanded_tensors(rank: int, world_size: int) -> dict:
    results = {}
    for algorithm in ("torch", *ALGORITHMS):
        for op in ("sum", "avg"):
            base = torch.tensor([[1.0, 2.0, 3.0]]) * (rank + 1)
            returned = comm.all_reduce(base.expand(4, 3), op=op, algorithm=algorithm)  # stride 0 along dim 0
            results[f"{algorithm} {op}"] = (base.clone(), returned.shape)
    # A rank whose elements at one memory location get different sums: one line, not torch's aliasing error.
    mine = torch.zeros(1, 3).expand(2, 3) if rank == 0 else torch.arange(6.0).view(2, 3)
    try:
        comm.all_reduce(mine, algorithm="shm")
        results["differing"] = ""
    except ValueError as err:
        results["differing"] = str(err)
    return results


def test_expanded_tensors_get_the_sums_through_the_memory_they_have():
    # Before, every algorithm raised torch's "unsupported operation: some elements of the input tensor and
    # the written-to tensor refer to a single memory location" on the copy back.
    per_rank = run_distributed(expanded_tensors, 3)
    total = torch.tensor([[1.0, 2.0, 3.0]]) * 6
    for rank, results in enumerate(per_rank):
        for name, outcome in results.items():
            if name == "differing":
                continue
            base, shape = outcome
            assert shape == (4, 3) and torch.equal(base, total / 3 if name.endswith("avg") else total), (rank, name, base)
    assert "share memory but their sums differ" in per_rank[0]["differing"] and "\n" not in per_rank[0]["differing"]
    assert per_rank[1]["differing"] == per_rank[2]["differing"] == ""
