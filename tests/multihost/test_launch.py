"""Jobs across test hosts (network namespaces): one `ringtrain train` launcher per host, as on real machines.

Each host is its own network stack; the hosts share this machine's host name and /dev/shm, which is what
would fool a host identity made of the host name (shm would then put all ranks on one "host").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from tests.jobs import Job
from tests.conftest import REPO
from tests.distributed import run_distributed
from tests.hosts import INTERFACE, SUBNET, Hosts, listening_sockets
from tests.trainers import train_run

pytestmark = pytest.mark.hosts

PORT = 29400
CONFIG = "configs/debug_mlp.toml"
SHORT = ["--set", "train.epochs=1"]


def _launchers(hosts: Hosts, nproc: int, run_dir: Path, *extra: str) -> list[Job]:
    return [
        Job("train", CONFIG, "--nproc", str(nproc), "--nnodes", str(hosts.count), "--node-rank", str(i),
            "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}", "--local-addr", hosts.addr(i), "--run-dir", str(run_dir),
            *SHORT, *extra, prefix=hosts.exec_prefix(i))
        for i in range(hosts.count)
    ]


class _Listeners(threading.Thread):
    """Every (address, port) anything listened on in each job's host while the jobs ran (``seen``), and each
    worker process on its own, by (job index, rank) (``by_worker``); sampled every 10 ms."""

    def __init__(self, jobs: list[Job], hosts: Hosts):
        super().__init__(daemon=True)
        self.jobs, self.hosts, self.seen = jobs, hosts, [set() for _ in jobs]
        self.by_worker: dict[tuple[int, int], set] = {}

    def run(self) -> None:
        while any(job.process.poll() is None for job in self.jobs):
            for i, job in enumerate(self.jobs):
                netns = self.hosts.ns(i)
                self.seen[i] |= listening_sockets(job.process.pid, netns=netns)
                for rank, worker in job.workers().items():
                    sockets = listening_sockets(worker.pid, own=True, netns=netns)
                    self.by_worker.setdefault((i, rank), set()).update(sockets)
            time.sleep(0.01)


def _finish(jobs: list[Job]) -> None:
    with ExitStack() as stack:  # every launcher's processes go, whichever fails
        for job in jobs:
            stack.enter_context(job)
        for job in jobs:
            assert job.finish(timeout=120) == 0, job.stderr


def _python(prefix: list[str], args: list[str], env: dict) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([*prefix, sys.executable, *args], cwd=REPO, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _digests(run_dir: Path) -> list[str]:
    return json.loads((run_dir / "summary.json").read_text())["param_sha256"]


def test_two_hosts_one_worker_each_train_as_on_one_host(make_hosts, tmp_path):
    hosts = make_hosts(2)
    jobs = _launchers(hosts, 1, tmp_path / "hosts")
    listeners = _Listeners(jobs, hosts)
    listeners.start()
    _finish(jobs)
    listeners.join()
    across = _digests(tmp_path / "hosts")
    assert len(across) == 2 and len(set(across)) == 1  # bit-identical replicas
    # The same job on loopback, two workers on one host: the same bits (sum of two addends, same order). The
    # trainer `ringtrain train` builds, run in the test harness (no launch).
    run_distributed(train_run, 2, CONFIG, SHORT[1::2], str(tmp_path / "local"), False)
    assert _digests(tmp_path / "local") == across
    # Every socket listened on in a host (launcher, agent, workers: the rendezvous, the workers' store, Gloo)
    # was bound to that host's address: none to loopback, none to every interface.
    assert {ip for ip, _ in listeners.seen[0]} == {hosts.addr(0)}, listeners.seen  # node 0 hosts the stores
    assert {ip for ip, _ in listeners.seen[1]} <= {hosts.addr(1)}, listeners.seen


def test_an_interface_with_two_addresses_listens_on_the_jobs(make_hosts, tmp_path):
    """Each host's one interface holds two addresses, the job's second (198.18.0.1 and .101 on host 0): a
    choice by interface (GLOO_SOCKET_IFNAME) took the first. Every socket every worker listens on (its store,
    the default group's Gloo device, the sharded checkpoints' own Gloo group) is on the job's address, and so
    is everything else that listens in the host."""
    hosts = make_hosts(2)
    job_addr = [f"{SUBNET}.{101 + i}" for i in range(hosts.count)]
    for i, address in enumerate(job_addr):
        hosts.add_address(i, address)
    jobs = [
        Job("train", CONFIG, "--nproc", "1", "--nnodes", "2", "--node-rank", str(i),
            "--rdzv-endpoint", f"{job_addr[0]}:{PORT}", "--local-addr", job_addr[i], "--run-dir", str(tmp_path),
            *SHORT, "--set", "checkpoint.sharded=true", prefix=hosts.exec_prefix(i))
        for i in range(hosts.count)
    ]
    listeners = _Listeners(jobs, hosts)
    listeners.start()
    _finish(jobs)
    listeners.join()
    print(f"listening: by worker {listeners.by_worker}, by host {listeners.seen}")
    assert sorted(rank for _, rank in listeners.by_worker) == [0, 1], listeners.by_worker
    for (i, rank), sockets in listeners.by_worker.items():
        # At least the two Gloo groups' listeners: a sample that missed them proves nothing.
        assert len(sockets) >= 2, (i, rank, sockets)
        assert {ip for ip, _ in sockets} == {job_addr[i]}, (i, rank, sockets)
    for i, sockets in enumerate(listeners.seen):
        assert {ip for ip, _ in sockets} == {job_addr[i]}, (i, sockets)


def test_two_hosts_two_workers_shm_goes_hierarchical(make_hosts, tmp_path):
    hosts = make_hosts(2)
    jobs = _launchers(hosts, 2, tmp_path, "--set", "comm.algorithm=shm")
    _finish(jobs)
    # Rank 0 saw two hosts of two ranks each: shm reduces inside each host and rings between the leaders.
    assert f"4 workers on 2 hosts: {hosts.addr(0)} ranks 0-1, {hosts.addr(1)} ranks 2-3" in jobs[0].stderr
    digests = _digests(tmp_path)
    assert len(digests) == 4 and len(set(digests)) == 1


def test_diloco_across_two_hosts_makes_each_hosts_workers_one_replica(make_hosts, tmp_path):
    """comm.strategy = 'diloco' on 2 hosts x 2 workers, diloco.inner left at 'auto': the host layout makes each
    host's two workers one replica (DDP over shm inside it), and only the two leaders exchange pseudo-gradients.
    A checkpoint taken between outer steps holds every rank's own parameters: the same bits inside a host,
    different between the hosts; the run ends on one model."""
    hosts = make_hosts(2)
    sync_every = 4
    jobs = _launchers(hosts, 2, tmp_path, "--set", "comm.strategy=diloco", "--set", "comm.algorithm=shm",
                      "--set", f"diloco.sync_every={sync_every}", "--set", "checkpoint.every_steps=6",
                      "--set", "checkpoint.keep_last=10")
    _finish(jobs)
    from ringtrain.checkpoint.manager import CheckpointManager

    done = json.loads((tmp_path / "summary.json").read_text())
    assert done["diloco_replicas"] == 2 and len(done["param_sha256"]) == 4 and len(set(done["param_sha256"])) == 1
    manager = CheckpointManager(tmp_path / "checkpoints", is_writer=False)
    ranks = manager.load(manager.path_for(6))["comm"]["ranks"]  # 6 % 4: two inner steps after an outer step
    params = [r["params"] for r in ranks]

    def same(a: int, b: int) -> bool:
        return all(torch.equal(x, y) for x, y in zip(params[a], params[b], strict=True))

    assert same(0, 1) and same(2, 3) and not same(0, 2)
    # Rank 0 (host 0's leader) sent one fp32 payload an outer step; nothing else crossed (the MLP has no buffers).
    payload = sum(p.numel() for p in params[0]) * 4
    outer_steps = -(-done["steps"] // sync_every)
    assert done["outer_steps"] == outer_steps and done["comm_bytes_per_worker"] == outer_steps * payload, done


_USER_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from ringtrain import comm
    from ringtrain.comm.shm_group import get_shm_group

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((300_000,), float(rank + 1))          # above shm's small-message size: the staged path
    comm.all_reduce(t, algorithm="shm")
    sg = get_shm_group(dist.group.WORLD)
    # One write of the whole line: with PYTHONUNBUFFERED set, print writes a line and its end separately to
    # the stdout the two workers share, and the other rank's line once landed between them.
    sys.stdout.write(json.dumps({"rank": rank, "sum": t.unique().tolist(), "hierarchical": sg.hierarchical,
                                 "leaders": sg.leaders, "local": sg.local}) + "\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
""")


def test_user_script_under_torchrun_finds_the_hosts(make_hosts, tmp_path):
    """comm.all_reduce(t, algorithm="shm") in a user's script under plain torchrun, GLOO_SOCKET_IFNAME naming
    each host's interface: comm finds the two hosts itself and goes hierarchical."""
    hosts = make_hosts(2)
    script = tmp_path / "user.py"
    script.write_text(_USER_SCRIPT)
    jobs = []
    try:
        for i in range(2):
            # torchrun hosts its store where the endpoint names this host; it cannot tell from an address
            # of a namespace, so say which node hosts it (torchrun's own is_host).
            torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}",
                        "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", hosts.addr(i), str(script)]
            jobs.append(_python(hosts.exec_prefix(i), torchrun, env={"GLOO_SOCKET_IFNAME": INTERFACE}))
        per_host = []
        for job in jobs:
            out, err = job.communicate(timeout=120)
            assert job.returncode == 0, err
            per_host.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    ranks = [sorted(r["rank"] for r in records) for records in per_host]
    assert sorted(ranks[0] + ranks[1]) == [0, 1, 2, 3] and len(ranks[0]) == len(ranks[1]) == 2
    for records, local in zip(per_host, ranks):
        for record in records:
            assert record["sum"] == [10.0]  # 1 + 2 + 3 + 4
            assert record["hierarchical"] and record["local"] == local  # this host's ranks, and only them
            assert record["leaders"] == sorted(min(r) for r in ranks)


@pytest.mark.exclusive  # the time to fail, against a bound
@pytest.mark.parametrize(
    ("flags", "named", "within_s"),
    [
        # Nobody at this address (no such host on the link): waits read_timeout, then one line.
        (["--rdzv-endpoint", f"198.18.0.9:{PORT}", "--rdzv-conf", "read_timeout=3"], f"198.18.0.9:{PORT}", 20),
        # Not this host's address.
        (["--rdzv-endpoint", f"198.18.0.1:{PORT}", "--local-addr", "198.18.0.7"], "198.18.0.7", 15),
        # No route at all from this host: at once.
        (["--rdzv-endpoint", f"198.19.0.1:{PORT}"], f"198.19.0.1:{PORT}", 15),
    ],
    ids=["unanswered-endpoint", "foreign-local-addr", "unroutable-endpoint"],
)
def test_wrong_addresses_fail_in_one_line(make_hosts, tmp_path, flags, named, within_s):
    hosts = make_hosts(2)
    start = time.monotonic()
    with Job("train", CONFIG, "--nnodes", "2", "--node-rank", "1", "--run-dir", str(tmp_path), *flags,
             prefix=hosts.exec_prefix(1)) as job:
        code = job.finish(timeout=60)
    took = time.monotonic() - start
    errors = [line for line in job.stderr.splitlines() if line.startswith("ringtrain: error:")]
    assert code == 2 and len(errors) == 1 and named in errors[0], job.stderr
    assert "Traceback" not in job.stderr and took < within_s, (took, job.stderr)
