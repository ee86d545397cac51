"""The one harness for every multi-process test: real processes joined by real Gloo.

    def check(rank, world_size, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t

    results = run_distributed(check, 3, 10)   # [rank 0's result, rank 1's, rank 2's]

``fn`` must be a module-level function (it is pickled by reference). Processes come from a forkserver
that has already imported torch, so starting a group costs milliseconds, not seconds. A rank that
raises fails the call with its traceback; a rank that hangs fails it after ``timeout_s``. Results are
pickled by value, so ranks may return tensors.

Failure tests name the ranks they kill or stop (``lost_ranks``): those are not waited for, their result
is None, and whatever is left of them is killed at the end::

    def victim(rank, world_size):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        ...

    results = run_distributed(victim, 3, lost_ranks={1})    # [rank 0's result, None, rank 2's]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

__all__ = ["run_distributed", "DistributedTestError"]

_CONTEXT = mp.get_context("forkserver")
_PRELOAD = ["tests.rank_preload"]
"""What the forkserver imports before it forks a rank (tests/rank_preload.py: torch, ringtrain's trainer, pytest).
One forkserver serves a test process: set again before every start (``run_distributed``), so a test module
that sets its own list cannot leave every later rank importing torch._dynamo and ringtrain on its own."""
_CONTEXT.set_forkserver_preload(_PRELOAD)


# The default start method of a launched worker (the platform's: fork on Linux with Python 3.11), which its
# DataLoader workers use. A rank the forkserver starts would otherwise inherit "forkserver" and start each
# loader worker as a new interpreter importing torch: seconds each, where a launched worker forks in milliseconds.
_LAUNCHED_START_METHOD = mp.get_all_start_methods()[0]


class DistributedTestError(AssertionError):
    pass


_NOT_FORMED = "group not formed"
"""A rank's report that Gloo failed to connect the group (``run_distributed`` starts the ranks again)."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60,
    collective_timeout_s: float = 30,
    lost_ranks: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results by rank.

    ``lost_ranks``: ranks the test itself kills or stops; not waited for, their result is None.

    Where Gloo fails to form the group itself (``connectFullMesh``: a connection between two ranks closed during
    the handshake, before ``fn`` ran anywhere; seen once in a full run, among the hundreds of groups it forms, on
    the loaded 2-core machine, and a known flake of PyTorch's own Gloo tests, pytorch#53270, #53138, #57469),
    the ranks are started once more on a fresh store, saying so on stderr: nothing of the code under test ran.
    """
    try:
        return _run_once(fn, world_size, args, timeout_s, collective_timeout_s, lost_ranks)
    except _GroupNotFormed as err:
        print(f"run_distributed: Gloo did not form the group of {world_size} ({err}); starting the ranks again",
              file=sys.stderr, flush=True)
    try:
        return _run_once(fn, world_size, args, timeout_s, collective_timeout_s, lost_ranks)
    except _GroupNotFormed as err:
        raise DistributedTestError(f"Gloo did not form the group of {world_size} twice:\n{err.detail}") from None


class _GroupNotFormed(Exception):
    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank}: {detail.strip().splitlines()[-1]}")
        self.detail = detail


def _run_once(fn, world_size: int, args: tuple, timeout_s: float, collective_timeout_s: float,
              lost_ranks: Collection[int]) -> list[Any]:
    _CONTEXT.set_forkserver_preload(_PRELOAD)  # no effect once the forkserver runs
    with tempfile.TemporaryDirectory(prefix="ringtrain-test-") as tmp:
        init_file = os.path.join(tmp, "store")
        results: mp.Queue = _CONTEXT.Queue()
        processes = [
            _CONTEXT.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, collective_timeout_s, results, args),
                name=f"rank{rank}",
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            return _collect(processes, results, world_size, timeout_s, frozenset(lost_ranks))
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)


def _collect(processes, results: mp.Queue, world_size: int, timeout_s: float, lost: frozenset[int]) -> list[Any]:
    outcome: dict[int, Any] = {rank: None for rank in lost}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in processes if not p.is_alive() and int(p.name[4:]) not in outcome]
            if dead and results.empty():
                time.sleep(0.5)  # a last report may still be in the pipe
                if results.empty():
                    codes = {p.name: p.exitcode for p in dead}
                    raise DistributedTestError(f"worker(s) died without reporting: exit codes {codes}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s} s")
            continue
        if ok == _NOT_FORMED:
            raise _GroupNotFormed(rank, value)
        if not ok:
            raise DistributedTestError(f"rank {rank} raised:\n{value}")
        outcome[rank] = pickle.loads(value)
    return [outcome[rank] for rank in range(world_size)]


def _worker(fn, rank, world_size, init_file, collective_timeout_s, results, args) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    mp.set_start_method(_LAUNCHED_START_METHOD, force=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout_s),
            )
        except RuntimeError as err:
            if "connectFullMesh" not in str(err):
                raise
            results.put((rank, _NOT_FORMED, traceback.format_exc()))
            return
        try:
            value = fn(rank, world_size, *args)
        finally:
            # Keep the group referenced past its destroy: this process ends with os._exit, so it is never
            # freed. Freed here, its last reference could be dropped on one of its own Gloo threads (e.g. by
            # PowerSGD's callbacks), whose destructor would then join itself and abort the worker.
            group = dist.group.WORLD  # noqa: F841
            dist.destroy_process_group()
        # Pickled here, by value: torch's queue reductions would pass tensors as file descriptors that die
        # with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
