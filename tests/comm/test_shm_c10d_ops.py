"""The ``ringtrain_shm`` c10d backend's collectives (comm/c10d_backend.py, comm/shm_ops.py) against Gloo.

One group per world size (2, 3, 4) runs every case: each op (all_gather, all_gather_into_tensor and its coalesced
form, reduce_scatter and reduce_scatter_tensor with sum, avg, max, min and product, broadcast, all_to_all_single
with uneven splits, all_to_all, the all-reduces of every op, barrier) × dtype (fp32, fp64, bf16, fp16, int64,
int32, bool, complex64) × size (0, 1, odd, more than one staging piece: the group's pieces are 4 KB here), on
the shm group and on the Gloo group of the same ranks, with the same inputs. Inputs are small whole numbers, so
every summation order gives the same bits: results must be bit-identical to Gloo's on every rank, and each case
must have run on shm (the group's per-op counter). Random floats are checked to the summation-order bound. Then
the profiler events, and a peer SIGKILLed inside an all_gather.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
          torch.complex64)
SIZES = (0, 1, 7, 5003)  # 5003 fp32: 20 KB, five 4 KB pieces (and many of reduce_scatter's per-rank slots)
PIECE_KB = 4


def _ops(dtype: torch.dtype) -> list[str]:
    if dtype.is_complex:
        return ["sum", "avg"]
    return ["sum", "max", "min", "product"] + (["avg"] if dtype.is_floating_point else [])


def _values(dtype: torch.dtype, numel: int, seed: int, op: str = "sum") -> torch.Tensor:
    """Whole numbers small enough that any order of 4 sums or products is exact in every dtype (bf16 too)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if op == "product":  # -2, -1, 1, 2
        magnitude = torch.randint(1, 3, (numel,), generator=gen)
        values = magnitude * (1 - 2 * torch.randint(0, 2, (numel,), generator=gen))
    else:
        values = torch.randint(-3, 4, (numel,), generator=gen)
    if dtype.is_complex:
        return torch.complex(values.float(), torch.randint(-3, 4, (numel,), generator=gen).float()).to(dtype)
    return values.to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        # Gloo's sums of bools leave bytes of 2 (True + True, an invalid bool); shm's torch.add leaves 1: equal
        # as bools, which is what a bool holds.
        return (flat.view(torch.uint8) != 0).view(torch.uint8)
    return flat.view(torch.uint8)


def _split_rows(i: int, j: int, numel: int) -> int:
    """Rows rank i sends rank j in the all-to-all cases: uneven, some zero; scaled with the case's size."""
    return ((3 * i + 5 * j + numel) % 4) * (numel // 8 + 1) if numel else 0


def _op(name: str):
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT}[name]


def against_gloo(rank: int, world_size: int) -> dict:
    """Every case on the shm group and on Gloo (the default group): the cases whose bits differ, and those that
    did not run on shm."""
    from ringtrain.comm.c10d_backend import BACKEND

    shm = dist.new_group(backend=BACKEND)
    shm.init_shm(piece_kb=PIECE_KB)
    gloo = dist.group.WORLD
    mismatched, not_on_shm, cases = [], [], 0

    def case(name: str, op_key: str | None, run) -> None:
        """``run(group)`` returns the result tensors; shm's must equal Gloo's bit for bit, and run on shm."""
        nonlocal cases
        cases += 1
        before = shm.shm_ops[op_key]
        got = run(shm)
        if op_key is not None and shm.shm_ops[op_key] != before + 1:
            not_on_shm.append(name)
        expected = run(gloo)
        for g, e in zip(got, expected):
            if g.dtype != e.dtype or g.shape != e.shape or not torch.equal(_bits(g), _bits(e)):
                mismatched.append(name)
                break

    n = world_size
    for dtype in DTYPES:
        for numel in SIZES:
            tag = f"{str(dtype)[6:]}×{numel}"
            mine = _values(dtype, numel, 1000 * rank + numel)

            def all_gather(group):
                outs = [torch.full((numel,), 9).to(dtype) for _ in range(n)]
                dist.all_gather(outs, mine.clone(), group=group)
                return outs

            def all_gather_into_tensor(group):
                out = torch.full((n * numel,), 9).to(dtype)
                dist.all_gather_into_tensor(out, mine.clone(), group=group)
                return [out]

            def broadcast(group):
                t = mine.clone()
                dist.broadcast(t, src=n - 1, group=group)
                return [t]

            def all_to_all_single(group):
                sends = [_split_rows(rank, j, numel) for j in range(n)]
                receives = [_split_rows(j, rank, numel) for j in range(n)]
                source = _values(dtype, 3 * sum(sends), 7 * rank + numel).view(-1, 3)
                out = torch.full((sum(receives), 3), 9).to(dtype)
                dist.all_to_all_single(out, source, receives, sends, group=group)
                return [out]

            def all_to_all(group):
                # Gloo's takes equal sizes only (shm's any: all_to_all_single checks uneven ones).
                inputs = [_values(dtype, numel, 11 * rank + j) for j in range(n)]
                outs = [torch.full((numel,), 9).to(dtype) for j in range(n)]
                dist.all_to_all(outs, inputs, group=group)
                return outs

            case(f"all_gather {tag}", "all_gather", all_gather)
            case(f"all_gather_into_tensor {tag}", "all_gather", all_gather_into_tensor)
            case(f"broadcast {tag}", "broadcast", broadcast)
            case(f"all_to_all_single {tag}", "all_to_all", all_to_all_single)
            case(f"all_to_all {tag}", "all_to_all", all_to_all)
            for op in _ops(dtype):
                data = _values(dtype, numel * n, 100 * rank + numel, op)

                def all_reduce(group):
                    t = data[:numel].clone()
                    dist.all_reduce(t, op=_op(op), group=group)
                    return [t]

                def reduce_scatter_tensor(group):
                    out = torch.full((numel,), 9).to(dtype)
                    dist.reduce_scatter_tensor(out, data.clone(), op=_op(op), group=group)
                    return [out]

                def reduce_scatter(group):
                    out = torch.full((numel,), 9).to(dtype)
                    dist.reduce_scatter(out, list(data.clone().chunk(n)) if numel else [data] * n, op=_op(op), group=group)
                    return [out]

                case(f"all_reduce({op}) {tag}", "all_reduce", all_reduce)
                case(f"reduce_scatter_tensor({op}) {tag}", "reduce_scatter", reduce_scatter_tensor)
                if op in ("sum", "max"):
                    case(f"reduce_scatter({op}) {tag}", "reduce_scatter", reduce_scatter)

    # The coalesced forms FSDP2 issues: one work for several tensors, each on shm.
    inputs = [_values(torch.float32, size, rank) for size in (5003, 3)]

    def coalesced(group):
        outs = [torch.zeros(n * t.numel()) for t in inputs]
        with dist._coalescing_manager(group=group, async_ops=True) as manager:
            for out, t in zip(outs, inputs):
                dist.all_gather_into_tensor(out, t, group=group)
        manager.wait()
        shards = [torch.zeros(t.numel()) for t in inputs]
        with dist._coalescing_manager(group=group, async_ops=True) as manager:
            for shard, out in zip(shards, outs):
                dist.reduce_scatter_tensor(shard, out, group=group)
        manager.wait()
        return outs + shards

    before = dict(shm.shm_ops)
    case("coalesced all_gather + reduce_scatter", None, coalesced)
    if shm.shm_ops["all_gather"] - before["all_gather"] != 2 or shm.shm_ops["reduce_scatter"] - before["reduce_scatter"] != 2:
        not_on_shm.append("coalesced")
    # Not on the fast path: a non-contiguous input goes to Gloo, as before, and gives Gloo's values.
    calls = shm.shm_calls
    strided = torch.arange(12.0).view(3, 4).t() + rank
    outs = [torch.zeros(4, 3) for _ in range(n)]
    dist.all_gather(outs, strided, group=shm)
    if shm.shm_calls != calls or not all(torch.equal(o, strided - rank + j) for j, o in enumerate(outs)):
        mismatched.append("non-contiguous all_gather (Gloo's)")
    before = shm.shm_ops["barrier"]
    dist.barrier(group=shm)
    if shm.shm_ops["barrier"] != before + 1:
        not_on_shm.append("barrier")

    # Random floats: shm adds in rank order, Gloo in its own; equal to the bound of an n-term sum.
    floats = torch.randn(5003 * n, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    errors = []
    sizes = floats.abs().clone()
    dist.all_reduce(sizes, group=gloo)
    for name, run, which in (("all_reduce", lambda g, t: dist.all_reduce(t[:5003], group=g), 0),
                             ("reduce_scatter", lambda g, t: dist.reduce_scatter_tensor(t[:5003], t.clone(), group=g), rank)):
        a, b = floats.clone(), floats.clone()
        run(shm, a)
        run(gloo, b)
        bound = n * torch.finfo(torch.float32).eps * sizes[which * 5003 : (which + 1) * 5003]
        errors.append((name, bool(((a[:5003] - b[:5003]).abs() <= bound).all())))
    # Every rank holds the same bits after a float all-reduce on shm.
    t = floats[:5003].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=shm)
    everyone = [torch.zeros(5003) for _ in range(n)]
    dist.all_gather(everyone, t, group=gloo)
    same = all(torch.equal(_bits(x), _bits(everyone[0])) for x in everyone)
    return {"cases": cases, "mismatched": mismatched, "not_on_shm": not_on_shm, "errors": errors, "same": same}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_dtype_and_size_matches_gloo_bit_for_bit_on_shm(world_size):
    for result in run_distributed(against_gloo, world_size, timeout_s=300, collective_timeout_s=60):
        assert result["cases"] > 300
        assert result["mismatched"] == [], result["mismatched"]
        assert result["not_on_shm"] == [], result["not_on_shm"]
        assert all(ok for _, ok in result["errors"]), result["errors"]
        assert result["same"]


def profiled(rank: int, world_size: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=BACKEND)
    x = torch.ones(8)
    dist.all_reduce(x, group=group)  # the workspace is set up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(x, group=group)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        dist.all_gather_into_tensor(torch.zeros(8 * world_size), x, group=group)
        dist.reduce_scatter_tensor(torch.zeros(8), torch.ones(8 * world_size), group=group)
        dist.broadcast(x, src=0, group=group)
        dist.all_to_all_single(torch.zeros(8), torch.ones(8), group=group)
        dist.barrier(group=group)
    return sorted({event.name for event in prof.events() if event.name.startswith("ringtrain_shm:")})


def test_every_collective_on_shm_records_a_profiler_event():
    for names in run_distributed(profiled, 2, timeout_s=120):
        assert names == [f"ringtrain_shm:{op}" for op in
                         ("all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "reduce_scatter")]


def profiled_as_torch_asks(rank: int, world_size: int) -> dict:
    """Each call under torch's autograd profiler as torch's c10d tests profile it (``call_dist_op``): the
    ``ringtrain_shm:<op>`` events it recorded, each as (asynchronous, input shapes)."""
    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=BACKEND)
    x = torch.ones(8)
    dist.all_reduce(x, group=group)  # the workspace is set up outside the profiles
    peer = 1 - rank
    calls = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),  # the native sum
        "all_gather": lambda: dist.all_gather_into_tensor(torch.zeros(8 * world_size), x, group=group),  # shm_ops
        "reduce": lambda: dist.reduce(x, dst=0, group=group),  # handed to Gloo
        # An op shm does not take, handed to Gloo by an op that does take others (a bitwise and on shm's dtype).
        "all_reduce:band": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64), op=dist.ReduceOp.BAND, group=group),
        "send" if rank == 0 else "recv": lambda: (dist.isend if rank == 0 else dist.irecv)(x, peer, group=group).wait(),
    }
    found = {}
    for case, call in calls.items():
        op = case.split(":")[0]
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            call()
        found[case] = [(e.is_async, e.input_shapes) for e in prof.function_events if e.name == f"ringtrain_shm:{op}"]
        found[f"{case} on gloo"] = any(e.name.startswith("gloo:") for e in prof.function_events)
    return found


def test_each_call_records_one_asynchronous_event_with_its_shapes_as_c10d_does():
    """torch's c10d tests ask it of every backend: one ``<backend>:<op>`` event a call, asynchronous (c10d's Work
    ends its event where the work completes), with the inputs' shapes; for the ops handed to Gloo too, those it
    never runs (reduce) and those it runs on shm but not for these arguments (a bitwise and)."""
    for rank, found in enumerate(run_distributed(profiled_as_torch_asks, 2, timeout_s=120)):
        p2p = "send" if rank == 0 else "recv"
        cases = ("all_reduce", "all_gather", "reduce", "all_reduce:band", p2p)
        assert {case: found[case] for case in cases} == {case: [(True, [[8]])] for case in cases}, (rank, found)
        assert [case for case in cases if found[f"{case} on gloo"]] == ["reduce", "all_reduce:band"], (rank, found)


def killed_inside_all_gather(rank: int, world_size: int) -> dict:
    from ringtrain.comm import flight
    from ringtrain.comm.c10d_backend import BACKEND
    from ringtrain.comm.errors import CollectiveError

    group = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=5))
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    flight.enable(100)
    x = torch.ones(4 << 20 >> 2)  # 4 MB each: a gather of several staging pieces
    out = torch.zeros(world_size * x.numel())
    dist.all_gather_into_tensor(out, x, group=group)
    if rank == 1:
        # The timer's thread kills the process while the main thread is inside a gather.
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        while True:
            dist.all_gather_into_tensor(out, x, group=group)
    except CollectiveError as err:
        entries = flight.recorder().snapshot()["collectives"][-2:]
        return {"type": type(err).__name__, "message": str(err), "peer": err.peer, "pids": pids,
                "last": [{"op": e["op"], "algorithm": e["algorithm"], "ended": e["end_ns"] is not None} for e in entries]}


@pytest.mark.exclusive
def test_a_peer_killed_inside_an_all_gather_is_named_in_one_line():
    results = run_distributed(killed_inside_all_gather, 3, lost_ranks={1}, collective_timeout_s=5.0, timeout_s=120)
    for rank in (0, 2):
        result = results[rank]
        assert result["type"] == "PeerDiedError" and result["peer"] == 1, result
        message = result["message"]
        assert "\n" not in message and message.startswith("shm all_gather: rank 1 (pid") and "died" in message, message
        # The flight recorder's last entry is the gather that never ended, after one that did.
        assert result["last"] == [{"op": "all_gather", "algorithm": "shm", "ended": ended} for ended in (True, False)], result["last"]
    pids = {str(pid) for pid in results[0]["pids"]}
    left = [name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX) and name.split("-")[1] in pids]
    assert left == []  # the workspace's name went at set-up: nothing of this job stays in /dev/shm


def fsdp_steps(rank: int, world_size: int, backend: str) -> dict:
    """Three steps of FSDP2 (fully_shard per layer and the root) over a 1-D mesh of ``backend``."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ringtrain.comm.c10d_backend import BACKEND

    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    override = {"dp": BACKEND} if backend == BACKEND else None
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",), backend_override=override)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 33, generator=gen), torch.randn(8, 5, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    group = mesh.get_group("dp")
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
            "ops": dict(getattr(group, "shm_ops", {}))}


def test_fsdp2_on_ringtrain_shm_matches_fsdp2_on_gloo_bit_for_bit():
    from ringtrain.comm.c10d_backend import BACKEND

    on_shm = run_distributed(fsdp_steps, 2, BACKEND, timeout_s=180)
    on_gloo = run_distributed(fsdp_steps, 2, "gloo", timeout_s=180)
    for shm_result, gloo_result in zip(on_shm, on_gloo):
        # Two ranks: each sum has two addends, which commute, so the order cannot change a bit.
        assert all(torch.equal(a, b) for a, b in zip(shm_result["params"], gloo_result["params"]))
        assert shm_result["ops"]["all_gather"] > 0 and shm_result["ops"]["reduce_scatter"] > 0, shm_result["ops"]
    assert not torch.equal(on_shm[0]["params"][0], fsdp_steps_initial())  # the steps changed the weights


def fsdp_steps_initial() -> torch.Tensor:
    from torch import nn

    torch.manual_seed(0)
    return nn.Linear(33, 64).weight.detach()


def fsdp_strategy_on_shm(rank: int, world_size: int) -> dict:
    """``comm.strategy = 'fsdp'`` with ``comm.algorithm = 'shm'``: the strategy's mesh is a ringtrain_shm group."""
    from torch import nn

    from ringtrain.comm.c10d_backend import ShmProcessGroup
    from ringtrain.parallel.fsdp import FSDPStrategy

    torch.manual_seed(0)
    model = FSDPStrategy(torch.device("cpu"), algorithm="shm").wrap(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
    model(torch.randn(4, 16)).sum().backward()
    group = next(model.parameters()).device_mesh.get_group()
    return {"shm": isinstance(group, ShmProcessGroup), "ops": dict(getattr(group, "shm_ops", {}))}


def test_the_fsdp_strategy_with_algorithm_shm_runs_on_ringtrain_shm():
    for result in run_distributed(fsdp_strategy_on_shm, 2, timeout_s=120):
        assert result["shm"] and result["ops"]["all_gather"] > 0 and result["ops"]["reduce_scatter"] > 0, result


def across_hosts(rank: int, world_size: int) -> dict:
    """Ranks on two (pretended) hosts: the sum all-reduce takes shm's hierarchical path, the rest goes to Gloo."""
    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=BACKEND)
    group.init_shm(hosts=[f"host{r}" for r in range(world_size)])
    total = torch.full((5,), float(rank + 1))
    dist.all_reduce(total, group=group)
    outs = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(outs, torch.full((3,), float(rank)), group=group)
    biggest = torch.tensor([rank])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
    return {"total": total.tolist(), "gathered": [o[0].item() for o in outs], "max": biggest.item(), "ops": dict(group.shm_ops)}


def test_across_hosts_only_the_sum_all_reduce_runs_on_shm_and_the_rest_on_gloo():
    for result in run_distributed(across_hosts, 2, timeout_s=120):
        assert result["total"] == [3.0] * 5 and result["gathered"] == [0.0, 1.0] and result["max"] == 1, result
        assert result["ops"] == {"all_reduce": 1}, result["ops"]


def different_roots(rank: int, world_size: int) -> dict:
    from ringtrain.comm.c10d_backend import BACKEND
    from ringtrain.comm.errors import CollectiveError

    group = dist.new_group(backend=BACKEND)
    dist.barrier(group=group)
    try:
        dist.broadcast(torch.zeros(4), src=rank, group=group)  # each rank names itself the root: a mistake
    except CollectiveError as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None}


def test_ranks_that_disagree_on_a_collective_fail_naming_each_other_in_one_line():
    messages = []
    for result in run_distributed(different_roots, 2, timeout_s=120):
        assert result["type"] == "MismatchError" and "\n" not in result["message"], result
        messages.append(result["message"])
    # The rank that compares first names both calls; the other is told by the abort line, or compares too.
    assert any("from rank 0" in m and "from rank 1" in m for m in messages), messages
    assert all("from rank 0" in m or "called a different collective" in m for m in messages), messages


def disagreeing_splits(rank: int, world_size: int) -> dict:
    """Rank 1 sends rank 0 three elements where rank 0 expects two; everything else agrees."""
    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=BACKEND)
    sends = [2] * world_size
    receives = [2] * world_size
    if rank == 1:
        sends[0] = 3
    try:
        dist.all_to_all_single(torch.zeros(sum(receives)), torch.ones(sum(sends)), receives, sends, group=group)
    except ValueError as err:
        message = str(err)
    else:
        message = None
    # The group still works: the sizes are checked before any rank reads, and every rank fails at that round.
    total = torch.ones(5)
    dist.all_reduce(total, group=group)
    return {"message": message, "total": total.tolist()}


def test_all_to_all_split_sizes_that_disagree_fail_on_every_rank_in_the_same_line():
    results = run_distributed(disagreeing_splits, 3, timeout_s=120)
    expected = ("shm all_to_all: rank 1 sends 12 bytes to rank 0, which expects 8; every rank's output split sizes "
                "must match its peers' input split sizes")
    assert [r["message"] for r in results] == [expected] * 3, results
    assert all(r["total"] == [3.0] * 5 for r in results), results
