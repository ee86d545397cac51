"""A host's link goes down mid-run: the other host's ranks fail within [dist] timeout_s plus a few seconds,
with one line naming the unreachable host (its address), its ranks, the operation and the step; the cut
host's own ranks say that the job store does not answer them."""

from __future__ import annotations

import re
import time
from contextlib import ExitStack

import pytest

from tests.jobs import last_step
from tests.multihost.jobs import start_node_jobs

pytestmark = pytest.mark.hosts

TIMEOUT_S = 5


@pytest.mark.exclusive  # the time to name the host, against a bound
def test_link_cut_mid_run_names_the_unreachable_host(make_hosts, tmp_path):
    hosts = make_hosts(2)
    with ExitStack() as stack:
        jobs = start_node_jobs(stack, hosts, tmp_path, timeout_s=TIMEOUT_S)
        jobs[0].wait_for(lambda: last_step(tmp_path) >= 10, timeout=120, what="step 10")
        hosts.cut(1)
        cut_at = time.monotonic()
        seen_at, line = jobs[0].wait_for_line("is unreachable", timeout=60)
        assert jobs[0].finish(timeout=60) == 1
        # The cut host's rank cannot reach the job store either, and says so (after the store's own timeout).
        _, cut_side = jobs[1].wait_for_line("does not answer either", timeout=60)
        assert f"this host ({hosts.addr(1)}) lost its link" in cut_side, cut_side
    # e.g. "step 37: all_reduce (DDP gradient sync) failed: host 198.18.0.2 (rank 1) is unreachable: ..."
    assert re.search(rf"step \d+: \w+ \(.+\) failed: host {re.escape(hosts.addr(1))} \(rank 1\) is unreachable", line), line
    took = seen_at - cut_at
    print(f"link cut -> '{line}' after {took:.1f} s (timeout_s {TIMEOUT_S})")
    assert took < TIMEOUT_S + 6, took
    errors = [entry for entry in jobs[0].stderr.splitlines() if "ringtrain: error" in entry]
    assert errors and all("Traceback" not in entry for entry in errors), jobs[0].stderr
