"""Every Gloo group a worker makes listens on the job's address (group/init.py ``bind_gloo_groups``), on real
Gloo processes: a heal's next generation (``Membership.form``) and a group of ``dist.new_group`` (the
sharded checkpoints'). The address is 127.0.0.2, which loopback answers for without being its first address:
the harness names the interface (``GLOO_SOCKET_IFNAME=lo``), by which torch would take 127.0.0.1. (The same
across test hosts, an interface with two addresses and a real job: tests/multihost/test_launch.py.)
"""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from ringtrain.group.init import bind_gloo_groups
from ringtrain.heal.membership import Generation, Membership
from ringtrain.group.jobstore import JobStore
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

JOB_ADDR = "127.0.0.2"


@pytest.fixture
def job_store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store.port
    del store


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def groups_on_the_job_address(rank: int, world_size: int, port: int):
    dist.destroy_process_group()  # the harness's group: this test makes its own, as a heal does
    before = _listening()
    bind_gloo_groups(JOB_ADDR)
    try:
        job_store = JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False)
        generation = Generation(1, (0, 1), member=rank)
        Membership(job_store, generation, timeout_s=20.0).form("gloo")
        side = dist.new_group(backend="gloo")
        total = torch.full((3,), float(rank + 1))
        dist.all_reduce(total)
        dist.all_reduce(total, group=side)  # both groups work: (1 + 2) * 2
        listening = _listening() - before
        dist.destroy_process_group()
    finally:
        bind_gloo_groups(None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the harness to destroy
    return sorted(listening), total.tolist()


def test_a_heals_group_and_a_new_group_listen_on_the_job_address(job_store_port):
    for listening, total in run_distributed(groups_on_the_job_address, 2, job_store_port):
        assert total == [6.0, 6.0, 6.0]
        # One listener per group (each Gloo device has one), both on the job's address.
        assert len(listening) == 2 and {ip for ip, _ in listening} == {JOB_ADDR}, listening
