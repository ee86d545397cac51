"""A whole host dies (every process on it SIGKILLed) mid-run: the other host's launcher fails within seconds
with one line naming the dead host's address and ranks, not a Gloo error; when the dead host is the one
that ran the rendezvous (node 0), the line says so: the rendezvous host is gone."""

from __future__ import annotations

import re
import time
from contextlib import ExitStack

import pytest

from tests.jobs import last_step
from tests.multihost.jobs import start_node_jobs

pytestmark = pytest.mark.hosts



@pytest.mark.exclusive  # the time to name the host, against a bound
@pytest.mark.parametrize("victim", [1, 0], ids=["worker-host", "rendezvous-host"])
def test_a_dead_host_is_named(make_hosts, tmp_path, victim):
    hosts = make_hosts(2)
    with ExitStack() as stack:
        jobs = start_node_jobs(stack, hosts, tmp_path, timeout_s=5)
        jobs[0].wait_for(lambda: last_step(tmp_path) >= 5, timeout=120, what="step 5")
        for proc in reversed(jobs[victim].tree()):  # the host dies: all of its processes at once
            proc.kill()
        died_at = time.monotonic()
        survivor = jobs[1 - victim]
        code = survivor.finish(timeout=60)
        took = time.monotonic() - died_at
    errors = [line for line in survivor.stderr.splitlines() if "ringtrain: error:" in line]
    print(f"host {hosts.addr(victim)} killed -> after {took:.1f} s: {errors[-1] if errors else survivor.stderr}")
    assert code != 0 and errors and took < 15, (took, survivor.stderr)
    assert all("Traceback" not in line and "pair.cc" not in line for line in errors), errors
    if victim == 1:
        # e.g. "step 11: all_reduce (DDP gradient sync) failed: host 198.18.0.2 (rank 1) is gone: every one of ..."
        assert re.search(rf"step \d+: .+ failed: host {re.escape(hosts.addr(1))} \(rank 1\) is gone", errors[-1]), errors
    else:
        assert f"the rendezvous host {hosts.addr(0)}" in errors[-1] and "is gone" in errors[-1], errors
