"""shm's native all-reduce (comm/csrc/shm_native.cpp) against torch.distributed, and its fallbacks.

Checked on real processes: the sums of every dtype the native path takes, at sizes on both sides of its
thresholds (direct, staged in one and in many pieces with plain and with streaming stores, streamed only
to the ranks on other cores, left to choose between them, in place in a shared arena), equal to Gloo's
(the same bits at 2 ranks; within the error bound of an n-term float sum at 3) and bit-identical on every
rank; that the Python path is really not taken then, and really taken with RINGTRAIN_SHM_NATIVE=0 or a
dtype the native path does not cover, interleaved with native calls in one group; a build that fails
falls back with one warning line; a rank killed inside a native call is named; nothing stays in /dev/shm.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm import flight, shm, shm_local, shm_native
from ringtrain.comm.shm_group import NATIVE_DIRECT_BYTES, NATIVE_IN_PLACE_BYTES, NATIVE_PIECE_BYTES, get_shm_group, near_mask
from ringtrain.comm.shm_group import destroy as destroy_shm
from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from tests.distributed import run_distributed



def _missing_prerequisite() -> str | None:
    """What this machine lacks to build the native all-reduce, if anything. Only a missing prerequisite skips:
    with them all present the module must build, and a build that fails (a compile error in shm_native.cpp, a
    broken build()) fails test_the_native_module_builds_here instead of skipping every test here as "could
    not be built". Cheap, and it loads nothing: a worker process imports this module too."""
    if os.environ.get(shm_native.ENV_SWITCH, "1").strip() == "0":
        return f"{shm_native.ENV_SWITCH}=0 switches the native shm all-reduce off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the native shm all-reduce is built for x86-64 only, not {platform.machine()}"
    compiler = os.environ.get("CXX", "c++")  # what torch's cpp_extension compiles with
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build the native shm all-reduce"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja, which torch's cpp_extension builds with, is not installed"
    return None


_MISSING = _missing_prerequisite()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

# Elements per dtype: tiny, at the direct threshold's edge, staged in one piece, staged in several pieces.
# Odd sizes so that shards and pieces end unevenly.
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")


def _sizes(dtype: torch.dtype) -> list[int]:
    item = torch.tensor([], dtype=dtype).element_size()
    return [1, 37, NATIVE_DIRECT_BYTES // item, NATIVE_DIRECT_BYTES // item + 5, 100_003, 3 * NATIVE_PIECE_BYTES // item + 11]


def _values(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-(1 << 20), 1 << 20, (numel,), generator=g).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _forbid_python_path() -> None:
    """In this worker process, make the Python path's algorithms raise: a call that took them fails."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Python shm path ran where the native one should have")

    for name in ("_direct", "_pipelined", "_in_place", "_staged"):
        setattr(shm, name, refuse)


def against_torch(rank: int, world_size: int) -> list[dict]:
    _forbid_python_path()
    native = get_shm_group(dist.group.WORLD).native
    reports = []
    for name in DTYPES:
        dtype = getattr(torch, name)
        for numel in _sizes(dtype):
            for op in ("sum", "avg") if dtype.is_floating_point else ("sum",):
                # Staged calls write the staging buffers with plain and with streaming stores, case by case;
                # every other streaming case with the ranks of this rank's parity taken as sharing its core
                # (their parts in plain stores, the rest streamed).
                native.stream_mode = len(reports) % 2
                native.near_mask = near_mask([[r % 2] for r in range(world_size)], rank) if len(reports) % 4 == 3 else 0
                x = _values(dtype, numel, seed=1000 * rank + numel)
                ours = x.clone()
                comm.all_reduce(ours, op=op, algorithm="shm")
                reference = x.clone()
                if op == "avg":
                    reference.div_(world_size)  # torch's answer for the same divide-then-sum
                dist.all_reduce(reference)
                if dtype.is_floating_point:
                    sum_abs = x.double().abs()
                    dist.all_reduce(sum_abs)
                    info = torch.finfo(dtype)
                    bound = 2 * ((world_size + 2) * info.eps * sum_abs + world_size * info.smallest_normal)
                    worst = float(((ours.double() - reference.double()).abs() - bound).max())
                else:
                    worst = float((ours != reference).sum())
                reports.append({"case": (name, numel, op), "same_bits": torch.equal(ours, reference),
                                "within_bound": worst <= 0, "digest": _digest(ours)})
    # Left to choose (the default), a size's calls try both kinds of store and keep the faster.
    native.stream_mode = 2
    x = _values(torch.float32, 3 * NATIVE_DIRECT_BYTES // 4 + 1, seed=rank)
    reference = x.clone()
    dist.all_reduce(reference)
    before, streamed = native.profile_stats()["streamed"], []
    for _ in range(20):
        ours = x.clone()
        comm.all_reduce(ours, algorithm="shm")
        streamed.append(native.profile_stats()["streamed"] - before - sum(streamed))
        assert torch.equal(ours, reference) or world_size > 2, "adaptive stores: not Gloo's bits"
    # Every rank: the first call plain, the second streaming, then what local rank 0 found faster.
    reports.append({"case": ("adaptive", len(x), "sum"), "same_bits": True,
                    "within_bound": streamed[:2] == [0, 1] and 0 < sum(streamed) < 20, "digest": _digest(ours)})
    return reports


@pytest.mark.ranks
@pytest.mark.parametrize("world_size", [2, 3])
def test_native_sums_match_torch_and_are_bit_identical_on_every_rank(world_size):
    results = run_distributed(against_torch, world_size, timeout_s=180)
    for cases in zip(*results):
        case = cases[0]["case"]
        assert len({c["digest"] for c in cases}) == 1, f"{case}: ranks differ"
        for c in cases:
            assert c["within_bound"], f"{case}: beyond the error bound of the sum"
            # Two addends commute and halving is exact: the same bits as Gloo at 2 ranks; integers always.
            if world_size == 2 or not case[0].startswith(("float", "bfloat")):
                assert c["same_bits"], f"{case}: not the bits torch.distributed gives"


@pytest.mark.unit
def test_ranks_pinned_to_the_same_single_core_are_near():
    # 4 ranks pinned round robin to 2 cores (as ringtrain pins its workers): 0 and 2 share a core, 1 and 3.
    assert [near_mask([[0], [1], [0], [1]], r) for r in range(4)] == [0b0100, 0b1000, 0b0001, 0b0010]
    # A rank free to run on several cores shares none; a peer with a wider mask is not near either.
    assert near_mask([[0, 1], [0], [0]], 0) == 0
    assert near_mask([[0], [0, 1], [0]], 0) == 0b100


def in_place_and_mixed(rank: int, world_size: int) -> dict:
    """A tensor in a shared arena (in place), then native and Python-path calls interleaved in one group;
    every call recorded once by the flight recorder, also those the native path handed on."""
    flight.enable(100)
    sg = get_shm_group(dist.group.WORLD) if dist.get_world_size() > 1 else None
    numel = NATIVE_IN_PLACE_BYTES // 4 + 17
    shared = shm.shared_empty(numel)
    digests, equal, in_place_barriers = [], [], []
    for round_index in range(3):
        x = _values(torch.float32, numel, seed=10 * round_index + rank)
        shared.copy_(x)
        before = sg.native.profile_stats()["barriers"]
        comm.all_reduce(shared, op="avg", algorithm="shm")
        in_place_barriers.append(sg.native.profile_stats()["barriers"] - before)  # 3 in place, 5 staged
        reference = x / world_size
        dist.all_reduce(reference)
        equal.append(torch.equal(shared, reference))
        digests.append(_digest(shared))
        # int16 and uint8: not native dtypes; they run the Python path on the same flags and buffers.
        for dtype, n in ((torch.int16, 70_001), (torch.uint8, 513), (torch.float32, 5000), (torch.int16, 7)):
            y = torch.full((n,), rank + 1, dtype=dtype)
            comm.all_reduce(y, algorithm="shm")
            equal.append(bool((y == world_size * (world_size + 1) // 2).all()))
    # Handed on by the native path's entry (not contiguous): reduced through a copy, recorded once.
    strided = torch.arange(40, dtype=torch.float32).view(8, 5).t()
    comm.all_reduce(strided, algorithm="shm")
    equal.append(torch.equal(strided, world_size * torch.arange(40, dtype=torch.float32).view(8, 5).t()))
    recorded = [(c["bytes"], c["dtype"]) for c in flight.recorder().snapshot()["collectives"]]
    return {"equal": equal, "digests": digests, "native": sg.native is not None, "arena": sg.find_arena(shared) is not None,
            "in_place_barriers": in_place_barriers, "recorded": recorded}


@pytest.mark.ranks
def test_in_place_and_python_path_calls_interleave_with_native_ones():
    results = run_distributed(in_place_and_mixed, 2, timeout_s=120)
    assert all(r["native"] and r["arena"] for r in results)
    assert all(all(r["equal"]) for r in results)
    assert results[0]["digests"] == results[1]["digests"]
    assert all(r["in_place_barriers"] == [3, 3, 3] for r in results), results[0]["in_place_barriers"]
    calls = [(NATIVE_IN_PLACE_BYTES + 68, "float32")] + [(70_001 * 2, "int16"), (513, "uint8"), (20_000, "float32"),
                                                          (14, "int16")]
    expected = calls * 3 + [(160, "float32")]
    assert all(r["recorded"] == expected for r in results), results[0]["recorded"]


def numbered_across_wrap(rank: int, world_size: int) -> dict:
    """More calls than the recorder keeps, native and Python-path ones interleaved (in regions), then the
    workspace closed (as a heal closes it) and more calls in the next one: the dump numbers every call of the
    process in order, the last ones kept."""
    flight.enable(12)
    calls = []
    for index in range(30):
        native = index % 3 != 2
        # float32 of its own size per call (native), int16 the Python path: the record says which call it is.
        tensor = torch.ones(100 + index, dtype=torch.float32 if native else torch.int16)
        with flight.region("DDP gradient sync" if native else "evaluation", step=index):
            comm.all_reduce(tensor, algorithm="shm")
        calls.append((tensor.nbytes, "float32" if native else "int16", index))
    before_close = flight.recorder().snapshot()["collectives"]
    destroy_shm(dist.group.WORLD)  # the workspace closes; its records stay with the recorder
    for index in range(30, 33):
        tensor = torch.ones(100 + index)
        comm.all_reduce(tensor, algorithm="shm")  # a new workspace for the same ranks
        calls.append((tensor.nbytes, "float32", None))
    after = flight.recorder().snapshot()["collectives"]
    flight.enable(12)  # resized: what the native ring held is dropped, so the dump starts here
    comm.all_reduce(torch.ones(5, dtype=torch.int16), algorithm="shm")  # the Python path's: the native ring stays empty
    resized = flight.recorder().snapshot()["collectives"]
    flight.enable(0)
    seen = lambda entries: [(e["seq"], e["bytes"], e["dtype"], e["step"], e["end_ns"] is not None) for e in entries]
    return {"before": seen(before_close), "after": seen(after), "resized": seen(resized), "calls": calls}


@pytest.mark.ranks
def test_the_flight_recorder_numbers_native_and_python_calls_as_one_sequence():
    results = run_distributed(numbered_across_wrap, 2, timeout_s=120)
    for result in results:
        calls = [tuple(c) for c in result["calls"]]
        # The native ring keeps its last 12 of 20 calls (from call 13), Python's deque all 10 of its own: the
        # merged window starts where both still hold everything, and the numbers count back from call 30.
        before = result["before"]
        assert len(before) == 18, before
        expected = [(seq, *calls[seq - 1], True) for seq in range(31 - len(before), 31)]
        assert [tuple(e) for e in before] == expected
        # After the close: the closed workspace's records, then the new one's, numbered on (31-33).
        after = [tuple(e) for e in result["after"]]
        assert [e[0] for e in after] == list(range(13, 34))
        assert after[-3:] == [(31 + i, *calls[30 + i][:2], None, True) for i in range(3)]
        assert after[: len(after) - 3] == [(seq, *calls[seq - 1], True) for seq in range(34 - len(after), 31)]
        assert [tuple(e) for e in result["resized"]] == [(34, 10, "int16", None, True)]


def one_core(rank: int, world_size: int) -> dict:
    """Every rank pinned to one core: waits sleep in the kernel (futex) and the arriving rank wakes them."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    digests, equal = [], []
    for numel in (1000, NATIVE_DIRECT_BYTES // 4 + 3, 3 * NATIVE_PIECE_BYTES // 4 + 11):
        for round_index in range(5):
            x = _values(torch.float32, numel, seed=100 * round_index + rank)
            ours = x.clone()
            comm.all_reduce(ours, algorithm="shm")
            reference = x.clone()
            dist.all_reduce(reference)
            sum_abs = x.abs()
            dist.all_reduce(sum_abs)
            equal.append(bool(((ours - reference).abs() <= 8 * torch.finfo(torch.float32).eps * sum_abs).all()))
            digests.append(_digest(ours))
    stats = get_shm_group(dist.group.WORLD).native.profile_stats()
    return {"equal": equal, "digests": digests, "sleeps": stats["sleeps"], "wakes": stats["wakes"]}


@pytest.mark.ranks
def test_ranks_sharing_one_core_sleep_until_woken_and_agree():
    results = run_distributed(one_core, 4, timeout_s=120)
    assert all(all(r["equal"]) for r in results)
    assert len({tuple(r["digests"]) for r in results}) == 1, "ranks differ"
    # On one core a waiting rank must give the core up, or its peers never arrive: it slept, and was woken.
    assert sum(r["sleeps"] for r in results) > 0 and sum(r["wakes"] for r in results) > 0


def switched_off(rank: int, world_size: int) -> dict:
    os.environ[shm_native.ENV_SWITCH] = "0"
    calls = {"python": 0}
    direct = shm_local._direct

    def counted(*args, **kwargs):
        calls["python"] += 1
        return direct(*args, **kwargs)

    shm_local._direct = counted
    x = torch.full((1000,), float(rank + 1))
    comm.all_reduce(x, algorithm="shm")
    return {"native": get_shm_group(dist.group.WORLD).native is not None, "python_calls": calls["python"],
            "sum_ok": bool((x == world_size * (world_size + 1) / 2).all())}


@pytest.mark.ranks
def test_the_environment_switch_turns_the_native_path_off():
    for result in run_distributed(switched_off, 2):
        assert result == {"native": False, "python_calls": 1, "sum_ok": True}


@pytest.mark.unit
def test_the_native_module_builds_here():
    """Every prerequisite is here (else the module skips): the build must succeed, and say why if it does not."""
    module = shm_native.build()  # raises with the compiler's reason
    assert "float32" in module.dtypes(), module.dtypes()


@pytest.mark.job
def test_a_build_that_fails_falls_back_with_one_warning_line(tmp_path):
    # A real failed build: an empty cache and a compiler that fails (torch's cpp_extension honours CXX).
    env = {**os.environ, "RINGTRAIN_CACHE_DIR": str(tmp_path), "CXX": "/bin/false", "PYTHONPATH": os.getcwd()}
    code = "from ringtrain.comm import shm_native; print(shm_native.load())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ringtrain: warning: the native shm all-reduce could not be built"), lines
    assert "using the Python path" in lines[0]


def killed_inside(rank: int, world_size: int) -> dict:
    x = torch.ones(16 << 20 >> 2)  # 16 MB: a native call of many pieces, long enough to be killed inside
    comm.all_reduce(x, algorithm="shm")
    if rank == 1:
        # The call releases the GIL: this thread kills the process while the main thread is in C++.
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    started = time.monotonic()
    try:
        while True:
            comm.all_reduce(x, algorithm="shm")
    except comm.CollectiveError as err:
        return {"type": type(err).__name__, "message": str(err), "peer": err.peer, "after_s": time.monotonic() - started}


@pytest.mark.ranks
@pytest.mark.exclusive  # nothing new in /dev/shm: no other test may make segments meanwhile
def test_a_rank_killed_inside_a_native_call_is_named():
    before = {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    results = run_distributed(killed_inside, 3, lost_ranks={1}, collective_timeout_s=5.0, timeout_s=60)
    for rank in (0, 2):
        result = results[rank]
        assert result["type"] == "PeerDiedError" and result["peer"] == 1, result
        assert "rank 1 (pid" in result["message"] and "died" in result["message"], result["message"]
    assert {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)} <= before  # nothing left behind
