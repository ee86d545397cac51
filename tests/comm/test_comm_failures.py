"""A rank killed or stopped in the middle of collectives: the others fail in time, naming it; no leftovers.

The victim rank starts a timer that signals its own process (SIGKILL, or SIGSTOP) while every rank loops
over all-reduces; the survivors report the error they got and how long after their last successful call.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

TIMEOUT_S = 3.0
VICTIM = 1


def loop_until_failure(rank: int, world_size: int, algorithm: str, signal_name: str, numel: int) -> dict:
    x = torch.ones(numel)
    comm.all_reduce(x, algorithm=algorithm)  # set-up (shm workspace) before the victim goes
    if rank == VICTIM:
        threading.Timer(0.3, os.kill, (os.getpid(), getattr(signal, signal_name))).start()
    last_ok = time.monotonic()
    try:
        for _ in range(1_000_000):
            comm.all_reduce(x, algorithm=algorithm)
            last_ok = time.monotonic()
    except comm.CollectiveError as err:
        return {"type": type(err).__name__, "message": str(err), "after_s": time.monotonic() - last_ok, "peer": err.peer}
    return {"type": None}


def _ringtrain_segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}


@pytest.mark.exclusive  # failure times against the timeout; nothing new in /dev/shm
@pytest.mark.parametrize(
    "algorithm, signal_name, world_size, numel",
    [
        ("shm", "SIGKILL", 3, 1000),          # small messages: direct path
        ("shm", "SIGSTOP", 3, 1_000_000),     # large messages: staged reduce-scatter + all-gather
        ("ring", "SIGKILL", 2, 100_000),
        ("ring_chunked", "SIGSTOP", 2, 100_000),
    ],
)
def test_survivors_fail_in_time_naming_the_lost_rank(algorithm, signal_name, world_size, numel):
    before = _ringtrain_segments()
    results = run_distributed(
        loop_until_failure, world_size, algorithm, signal_name, numel,
        collective_timeout_s=TIMEOUT_S, lost_ranks={VICTIM}, timeout_s=60,
    )
    for rank, result in enumerate(results):
        if rank == VICTIM:
            continue
        assert result["type"] is not None, f"rank {rank} never failed"
        print(f"rank {rank} after {result['after_s']:.2f} s: {result['message']}")
        assert result["peer"] == VICTIM and f"rank {VICTIM}" in result["message"], result["message"]
        assert algorithm.split("_")[0] in result["message"] and "all_reduce" in result["message"]
        if signal_name == "SIGKILL":
            # Death is noticed (pid gone, or the socket closed), well before the timeout.
            assert result["after_s"] < TIMEOUT_S, result
        else:
            # A stopped process may be resumed: it is given the whole timeout, then named.
            assert TIMEOUT_S - 0.5 < result["after_s"] < TIMEOUT_S + 3, result
    assert _ringtrain_segments() <= before, "shared memory left in /dev/shm"


def different_sizes(rank: int, world_size: int) -> str:
    try:
        comm.all_reduce(torch.ones(10 + rank), algorithm="shm")
    except comm.MismatchError as err:
        return str(err)
    return ""


def test_ranks_calling_with_different_sizes_fail_naming_each_other():
    messages = run_distributed(different_sizes, 2, collective_timeout_s=TIMEOUT_S)
    assert "rank 1 called all_reduce(sum) of 11 float32" in messages[0], messages[0]
    assert "rank 0 called all_reduce(sum) of 10 float32" in messages[1], messages[1]


def different_unsigned_dtypes(rank: int, world_size: int) -> str:
    # all_gather only copies, so torch's missing uint16/uint32 arithmetic does not stop it: only the check can.
    try:
        comm.all_gather(torch.zeros(10, dtype=torch.uint16 if rank == 0 else torch.uint32), algorithm="shm")
    except comm.MismatchError as err:
        return str(err)
    return ""


def test_ranks_calling_with_dtypes_of_no_common_code_fail_naming_each_other():
    # Before, every dtype outside the common nine shared one code: uint16 against uint32 passed the check.
    messages = run_distributed(different_unsigned_dtypes, 2, collective_timeout_s=TIMEOUT_S)
    assert "rank 1 called all_gather(sum) of 10 uint32" in messages[0], messages[0]
    assert "rank 0 called all_gather(sum) of 10 uint16" in messages[1], messages[1]


def segment_names(rank: int, world_size: int) -> dict:
    sg = shm.init_shm(hosts=["a", "a", "b", "b"][:world_size])
    tensor = shm.shared_empty(1000)
    comm.all_reduce(tensor.fill_(1.0), algorithm="shm")
    return {"workspace": sg.segment.name, "listed": sorted(_ringtrain_segments()), "sum": tensor[0].item()}


@pytest.mark.exclusive  # nothing new in /dev/shm: no other test may make segments meanwhile
def test_segments_are_unlinked_as_soon_as_every_rank_has_mapped_them():
    before = _ringtrain_segments()
    for result in run_distributed(segment_names, 4):
        assert result["workspace"] not in result["listed"]
        assert set(result["listed"]) <= before, "a segment is still named while in use"
        assert result["sum"] == 4.0
    assert _ringtrain_segments() <= before
