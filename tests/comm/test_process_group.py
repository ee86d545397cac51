"""init_distributed in real worker processes: core pinning of the compute thread, and nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.job

# One worker: bring the group up as `ringtrain train` does, report which cores each thread may use.
_WORKER = """
import json, os, sys
import torch.distributed as dist
from ringtrain.config import DistConfig
from ringtrain.group.env import DistEnv
from ringtrain.group.init import init_distributed

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



# A world of one worker with two compute threads. OpenMP's thread pool is started BEFORE the group, while the
# process may only use its first core, as any parallel op of an import can start it: such a pool keeps that mask
# unless init_distributed re-pins it. Then the team torch's parallel regions run on (GNU OpenMP's pool of
# torch.get_num_threads() threads, observed from inside by GOMP_parallel) reports each thread's cores. No timing:
# what is asserted is the affinity the kernel holds, whatever the load. (Whether two threads make a matmul
# faster is measured by bench/threads_per_worker.py, not here.)
_TWO_THREAD_WORKER = """
import ctypes, json, os, threading
import torch
from ringtrain.config import DistConfig
from ringtrain.group.env import DistEnv
from ringtrain.group.init import init_distributed

torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
mapped = {line.split()[-1] for line in open("/proc/self/maps")}
gomp = sorted(path for path in mapped if path.startswith(torch_lib + "/libgomp"))
if "parallel backend: OpenMP" not in torch.__config__.parallel_info() or not gomp:
    print(json.dumps({"skip": "torch's intra-op threads are not GNU OpenMP's (libgomp in torch/lib) here"}))
    raise SystemExit
runtime = ctypes.CDLL(gomp[0])

def team():
    # Each thread of the team a parallel region of torch.get_num_threads() threads gets: its id and cores.
    seen = []
    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def report(_):
        seen.append((threading.get_native_id(), sorted(os.sched_getaffinity(0))))
    runtime.GOMP_parallel(report, None, ctypes.c_uint(torch.get_num_threads()), ctypes.c_uint(0))
    return sorted(seen)

allowed = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, allowed[:1])
torch.set_num_threads(2)
torch.ones(1 << 20).add_(1)  # a parallel op: the pool starts with the first core only
before = team()
os.sched_setaffinity(0, allowed)
with init_distributed(DistEnv(), DistConfig(backend="gloo", pin_cpu=True, threads_per_worker=2)):
    after = team()
    main = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
print(json.dumps({"before": before, "after": after, "main": main, "threads": threads, "me": threading.get_native_id()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two compute threads need two cores")
def test_two_threads_per_worker_are_pinned_to_the_worker_s_two_cores_even_if_openmp_started_early():
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a world of one
    done = subprocess.run([sys.executable, "-c", _TWO_THREAD_WORKER], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    before, after = report["before"], report["after"]
    assert report["threads"] == 2 and len(after) == 2, f"two compute threads expected: {report}"
    assert report["me"] in [tid for tid, _ in after], "the main thread is one of the team"
    # The set-up worked: the pool's threads existed before the group and held the first core only.
    assert [tid for tid, _ in before] == [tid for tid, _ in after], "OpenMP started new threads: nothing to prove"
    assert all(affinity == cores[:1] for _, affinity in before), before
    # The worker's two cores: all of a 2-core machine, the first two of a larger one.
    assert report["main"] == cores[:2], f"the main compute thread may use {report['main']}"
    assert all(affinity == cores[:2] for _, affinity in after), f"OpenMP's threads were not re-pinned: {after}"


# Where glibc puts a fresh process's first 20 MB block, and whether it keeps it once freed. mallinfo2
# reports the bytes in mmap'ed blocks (hblkhd) and the size of the heap (arena).
_ALLOCATE_AND_FREE = """
import ctypes, json, sys
import torch
from ringtrain.host.allocator import keep_freed_memory

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
