"""This host's share of the machine: where a worker sits among the host's workers, and the cores its compute
threads are pinned to (so co-located workers do not migrate and collide).

Apart from the process group's lifetime (ringtrain/group/): this is about the host, not the job.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtrain.comm.groups import host_id
from ringtrain.comm.objects import all_gather_json

__all__ = ["host_placement", "cores_for_worker", "pin_compute_threads", "warn"]


def host_placement(bind_addr: str | None) -> tuple[int, int]:
    """(index among this host's workers, number of workers on this host), from one all_gather; hosts are
    told apart as shared memory tells them (``comm.groups.host_id``: not fooled by network namespaces).

    A job on several hosts says, from rank 0, how it sees them (each by its bind address, else its id):
    ``ringtrain: 4 workers on 2 hosts: 198.18.0.1 ranks 0-1, 198.18.0.2 ranks 2-3``."""
    mine = host_id()
    placed = all_gather_json([mine, bind_addr])  # JSON, not pickle: no peer's bytes are unpickled
    hosts = [host for host, _ in placed]
    same_host = [rank for rank, host in enumerate(hosts) if host == mine]
    if dist.get_rank() == 0 and len(set(hosts)) > 1:
        layout = ", ".join(
            f"{placed[ranks[0]][1] or host} ranks {_rank_span(ranks)}"
            for host, ranks in ((h, [r for r, x in enumerate(hosts) if x == h]) for h in dict.fromkeys(hosts))
        )
        print(f"ringtrain: {len(hosts)} workers on {len(set(hosts))} hosts: {layout}", file=sys.stderr, flush=True)
    return same_host.index(dist.get_rank()), len(same_host)


def _rank_span(ranks: list[int]) -> str:
    """[2, 3] -> '2-3'; [0, 2] -> '0,2'."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def cores_for_worker(
    host_rank: int, host_world_size: int, threads_per_worker: int, allowed: list[int], warn: Callable[[str], None]
) -> list[int]:
    """The cores this worker's compute threads may use: ``threads_per_worker`` of the ``allowed`` ones,
    disjoint from the other local workers' while the host has enough; round robin (shared) beyond that,
    which ``warn`` hears about (on the host's first worker).

        cores_for_worker(1, 2, 2, [0, 1, 2, 3, 4, 5, 6, 7], print)    # [2, 3]
    """
    needed = host_world_size * threads_per_worker
    if needed <= len(allowed):
        first = host_rank * threads_per_worker
        return allowed[first : first + threads_per_worker]
    if threads_per_worker > 1 and host_rank == 0:  # one line per host; one thread per worker shares silently
        warn(
            f"{host_world_size} workers x {threads_per_worker} threads_per_worker need {needed} cores, this host "
            f"allows {len(allowed)}: threads will share cores; set dist.threads_per_worker = "
            f"{max(1, len(allowed) // host_world_size)}"
        )
    first = host_rank * threads_per_worker
    return [allowed[(first + i) % len(allowed)] for i in range(min(threads_per_worker, len(allowed)))]


def warn(message: str) -> None:
    print(f"ringtrain: warning: {message}", file=sys.stderr, flush=True)


def pin_compute_threads(cores: list[int]) -> None:
    """Pin the compute threads (this one and torch's intra-op OpenMP threads) to ``cores``, so co-located
    workers do not migrate and collide.

    Only those: the backend's I/O threads, started by init_process_group, stay free to run on any core.
    Pinned beside a busy compute thread, each message hand-off waits for the scheduler's next tick (4 ms at
    250 Hz), which made a small Gloo all-reduce ~25x slower.
    """
    os.sched_setaffinity(0, cores)  # pid 0: the calling thread only
    if torch.get_num_threads() > 1:
        _pin_openmp_threads(cores)


def _pin_openmp_threads(cores: list[int]) -> None:
    """Give torch's intra-op (OpenMP) threads this thread's cores.

    Threads OpenMP starts from now on inherit the calling thread's mask, but a pool started earlier (by any
    parallel op) keeps the mask it had. With GNU OpenMP, torch's runtime, each thread of a team of this size
    sets its own; with another runtime, a parallel op here at least starts the pool with the inherited mask.
    """
    runtime = _gnu_openmp()
    if runtime is None:
        torch.ones(1 << 20).add_(1)  # big enough to use every intra-op thread
        return

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def pin_this_thread(_: int | None) -> None:
        os.sched_setaffinity(0, cores)

    # The same team torch's parallel regions get: this thread's pool, torch.get_num_threads() threads.
    runtime.GOMP_parallel(pin_this_thread, None, ctypes.c_uint(torch.get_num_threads()), ctypes.c_uint(0))


def _gnu_openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch's intra-op threads belong to, if torch uses one (else None)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:
        return None
    # Other packages (scikit-learn) bring their own copy: prefer torch's (torch/lib, or torch.libs in older wheels).
    torch_root = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep + "torch"
    ours = [path for path in loaded if path.startswith(torch_root)] or (loaded if len(loaded) == 1 else [])
    if not ours:
        return None
    try:
        runtime = ctypes.CDLL(ours[0])
    except OSError:
        return None
    return runtime if hasattr(runtime, "GOMP_parallel") else None
