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
