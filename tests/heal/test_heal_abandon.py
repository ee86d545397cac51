"""Abandoning a failed group on real Gloo processes (heal/groups.py ``abandon_group``, group/sockets.py): a rank
leaves the group while its own all-reduce is still in flight on it; the peer, blocked in a collective on that
live rank, must learn of it at once (its sockets shut down), not after the group's timeout, and the
abandoning rank's destroy must return at once, leaving nothing of the group for a later garbage collection.
The group is made the way a heal makes it (``Membership.form`` in the job store), with Gloo's lazy
connection asked for (``TORCH_GLOO_LAZY_INIT=1``): its pairs must still be connected, and recorded, in the init.
"""

from __future__ import annotations

import os
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.heal.groups import abandon_group
from ringtrain.heal.membership import Generation, Membership
from ringtrain.group.jobstore import JobStore
from ringtrain.group.sockets import _socket_fds, group_sockets
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

GROUP_TIMEOUT_S = 20.0


@pytest.fixture
def job_store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store.port
    del store


def abandon_in_flight(rank: int, world_size: int, port: int):
    dist.destroy_process_group()  # the harness's group: this test makes its own, as a heal does
    job_store = JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False)
    user_socket = _socket_fds()  # what the process held before the group (the job store client among it)
    membership = Membership(job_store, Generation(1, (0, 1), member=rank), timeout_s=GROUP_TIMEOUT_S)
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    membership.form("gloo")
    lazy_restored = os.environ.get("TORCH_GLOO_LAZY_INIT") == "1"
    recorded = group_sockets()
    untouched = all(user_socket.get(fd) != name for fd, name in recorded)
    group = weakref.ref(dist.group.WORLD)
    ones = torch.ones(4)
    dist.all_reduce(ones)  # the group works
    if rank == 0:
        # The peer: blocked in a collective on rank 1, which is alive and never takes part in it.
        started = time.monotonic()
        try:
            dist.recv(torch.empty(4), src=1)
            outcome = "completed"
        except RuntimeError:
            outcome = "failed"
        waited_s = time.monotonic() - started
        membership.store.set("peer-done", "1")
        abandon_group()
        gone = group() is None
    else:
        # The rank that sees the failure first: its all-reduce is in flight (rank 0 never joins it).
        work = dist.all_reduce(torch.ones(4), async_op=True)
        time.sleep(0.5)
        started = time.monotonic()
        abandon_group()
        waited_s = time.monotonic() - started
        gone = group() is None  # freed in abandon_group, though this rank still holds its in-flight work
        try:
            work.wait()
            outcome = "completed"
        except RuntimeError:
            outcome = "failed"
        del work
        membership.store.wait(["peer-done"], timedelta(seconds=GROUP_TIMEOUT_S * 2))
    result = (len(recorded), untouched, lazy_restored, outcome, waited_s, gone, dist.is_initialized())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the harness to destroy
    return result


@pytest.mark.exclusive  # waits timed against a 3 s bound
def test_a_peer_blocked_on_a_rank_that_abandons_its_group_learns_at_once(job_store_port):
    started = time.monotonic()
    (recorded0, untouched0, lazy0, peer, peer_waited_s, gone0, init0), \
        (recorded1, untouched1, lazy1, own, abandon_s, gone1, init1) = run_distributed(
            abandon_in_flight, 2, job_store_port, timeout_s=3 * GROUP_TIMEOUT_S)
    print(f"peer's recv failed after {peer_waited_s:.2f} s (0.5 s of it before the abandon), the abandoning rank's "
          f"abandon_group took {abandon_s:.3f} s (group timeout {GROUP_TIMEOUT_S:g} s); total "
          f"{time.monotonic() - started:.1f} s")
    # Eager despite TORCH_GLOO_LAZY_INIT: the one pair is connected in the init and recorded, nothing else.
    assert recorded0 == recorded1 == 1 and untouched0 and untouched1 and lazy0 and lazy1
    assert peer == "failed" and peer_waited_s < 3.0, (peer, peer_waited_s)
    assert abandon_s < 3.0, abandon_s  # without the shutdown: the in-flight all-reduce's timeout, 20 s
    assert own == "failed"  # the in-flight all-reduce failed, it did not hang on
    assert gone0 and gone1 and not init0 and not init1  # nothing of the group left for a garbage collection
