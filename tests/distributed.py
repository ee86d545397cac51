"""The one harness for every multi-process test: real processes joined by real Gloo.

    def check(rank, world_size, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t

    results = run_distributed(check, 3, 10)   # [rank 0's result, rank 1's, rank 2's]

``fn`` must be a module-level function (it is pickled by reference). Processes come from a forkserver
that has already imported torch, so starting a group costs milliseconds, not seconds. A rank that
raises fails the call with its traceback; a rank that hangs fails it after ``timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["run_distributed", "DistributedTestError"]

_CONTEXT = mp.get_context("forkserver")
# Also what building a trainer imports: torch._dynamo (DDP's constructor imports it: seconds), sklearn, ringtrain.
_CONTEXT.set_forkserver_preload(
    ["torch", "torch.distributed", "numpy", "torch._dynamo", "sklearn.datasets", "ringtrain.train.build"]
)


class DistributedTestError(AssertionError):
    pass


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60, collective_timeout_s: float = 30
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results by rank."""
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
            return _collect(processes, results, world_size, timeout_s)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)


def _collect(processes, results: mp.Queue, world_size: int, timeout_s: float) -> list[Any]:
    outcome: dict[int, Any] = {}
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
        if not ok:
            raise DistributedTestError(f"rank {rank} raised:\n{value}")
        outcome[rank] = value
    return [outcome[rank] for rank in range(world_size)]


def _worker(fn, rank, world_size, init_file, collective_timeout_s, results, args) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
