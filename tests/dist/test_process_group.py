"""init_distributed in real worker processes: core pinning of the compute thread, and nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO

# One worker: bring the group up as `ringtrain train` does, report which cores each thread may use.
_WORKER = """
import json, os, sys
import torch.distributed as dist
from ringtrain.config import DistConfig
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import init_distributed

with init_distributed(DistEnv.from_environ(), DistConfig(backend="gloo", pin_cpu=True)) as ctx:
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        threads.setdefault(name, []).append(sorted(os.sched_getaffinity(int(tid))))
    dist.barrier()
print(json.dumps({"rank": ctx.rank, "main": sorted(os.sched_getaffinity(0)), "threads": threads}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned from free")
def test_pinning_holds_the_compute_thread_to_one_core_and_leaves_gloo_threads_free():
    cores = sorted(os.sched_getaffinity(0))
    port = _free_port()
    workers = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RINGTRAIN_BIND_ADDR": "127.0.0.1"}
        workers.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in sorted(reports, key=lambda r: r["rank"]):
        assert report["main"] == [cores[report["rank"] % len(cores)]], "each worker computes on its own core"
        gloo = [affinity for name, affinities in report["threads"].items() if name.startswith(("gloo", "pt_gloo"))
                for affinity in affinities]
        assert gloo, f"no Gloo thread found among {sorted(report['threads'])}"
        # Pinned beside the compute thread, every message hand-off would wait for a scheduler tick.
        assert all(affinity == cores for affinity in gloo), f"Gloo threads were pinned too: {gloo}"



# A world of one worker with two compute threads: which threads did the matmul work, on which cores, and how
# much faster two threads make it than one (best of interleaved repeats: noise only ever slows a repeat down;
# with both threads on one core, two are never faster than one).
_TWO_THREAD_WORKER = """
import json, os, time
import torch
from ringtrain.config import DistConfig
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import init_distributed

def cpu_ticks():
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks

def matmul_s(a, threads):
    torch.set_num_threads(threads)
    start = time.perf_counter()
    a @ a
    return time.perf_counter() - start

with init_distributed(DistEnv(), DistConfig(backend="gloo", pin_cpu=True, threads_per_worker=2)):
    a = torch.randn(1024, 1024)
    before, end = cpu_ticks(), time.perf_counter() + 1.0
    while time.perf_counter() < end:
        a @ a
    after = cpu_ticks()
    # A compute thread is one that worked at least 0.2 s of that second.
    busy = [tid for tid, ticks in after.items() if ticks - before.get(tid, 0) >= 0.2 * os.sysconf("SC_CLK_TCK")]
    affinities = [sorted(os.sched_getaffinity(tid)) for tid in busy]
    # Best times of interleaved repeats; on a busy machine, more repeats until the best ones show through.
    best, deadline = {1: float("inf"), 2: float("inf")}, time.perf_counter() + 10
    for repeat in range(1000):
        for threads in (1, 2):
            best[threads] = min(best[threads], matmul_s(a, threads))
        if repeat >= 10 and (best[2] < 0.8 * best[1] or time.perf_counter() > deadline):
            break
print(json.dumps({"affinities": affinities, "one_thread_s": best[1], "two_threads_s": best[2]}))
"""


@pytest.mark.exclusive  # a speed-up measured in wall time
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two compute threads need two cores")
def test_two_threads_per_worker_compute_on_two_cores_and_a_matmul_gets_faster():
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a world of one
    done = subprocess.run([sys.executable, "-c", _TWO_THREAD_WORKER], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # OpenMP starts its threads after the pinning: they must get the worker's two cores, not one.
    assert report["affinities"] == [cores[:2], cores[:2]], f"compute threads and their cores: {report['affinities']}"
    one, two = report["one_thread_s"], report["two_threads_s"]
    load = os.getloadavg()[0]
    if two >= 0.85 * one and load > len(cores):
        # Other processes hold the cores (load above the core count): wall time cannot show a speed-up, and
        # the affinities above already show the threads were given two cores.
        pytest.skip(f"no speed-up measurable at load {load:.1f} on {len(cores)} cores ({two:.3f} s vs {one:.3f} s)")
    assert two < 0.85 * one, f"two threads took {two:.3f} s, one thread {one:.3f} s: no speed-up"


# Where glibc puts a fresh process's first 20 MB block, and whether it keeps it once freed. mallinfo2
# reports the bytes in mmap'ed blocks (hblkhd) and the size of the heap (arena).
_ALLOCATE_AND_FREE = """
import ctypes, json, sys
import torch
from ringtrain.dist.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                       "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory(), "glibc's thresholds were not set"
before = libc.mallinfo2()
block = torch.empty(5 << 20)  # 20 MB
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
print(json.dumps({"mmapped": during.hblkhd - before.hblkhd, "heap_after_free": after.arena}))
"""


def _where_20_mb_went(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD", "GLIBC_TUNABLES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _ALLOCATE_AND_FREE, mode], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_comes_from_the_heap_and_stays_there():
    default, kept = _where_20_mb_went("default"), _where_20_mb_went("keep")
    # glibc's default: a fresh process mmaps a block this large and unmaps it on free, so the next step
    # faults every page in again (what made ResNet-18's steps 8% slower).
    assert default["mmapped"] >= 20 << 20, f"glibc's default no longer mmaps a 20 MB block: {default}"
    assert kept["mmapped"] == 0, f"with keep_freed_memory the block was still mmapped: {kept}"
    assert kept["heap_after_free"] >= 20 << 20, f"the freed block left the heap: {kept}"
