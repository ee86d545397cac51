"""dist/heal.py's agreement on a real TCPStore: the survivors agree on the same next generation, a silent
member is left out, and a member that comes back after the decision is fenced (it must write nothing)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ringtrain.dist.heal import Fenced, Generation, Membership
from ringtrain.dist.jobstore import JobStore


@pytest.fixture
def job_store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store.port
    del store


def connect(port: int) -> JobStore:
    return JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False)


def beat_while(store: JobStore, member: int, stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1
        store.beat(member, count)
        stop.wait(0.05)


def test_survivors_agree_a_silent_member_is_left_out_and_fenced_when_it_returns(job_store_port):
    members = (0, 1, 2)
    stop = threading.Event()
    beaters = [threading.Thread(target=beat_while, args=(connect(job_store_port), m, stop), daemon=True) for m in (0, 1)]
    connect(job_store_port).beat(2, 1)  # member 2 beat once, then stopped (killed or SIGSTOPped)
    for thread in beaters:
        thread.start()
    results: dict[int, Generation] = {}

    def survivor(member: int) -> None:
        membership = Membership(connect(job_store_port), Generation(0, members, member), timeout_s=10,
                                silent_after_s=0.3)
        membership.publish_failure(step=7)
        results[member] = membership.agree(applied_step=6 + member % 2)

    threads = [threading.Thread(target=survivor, args=(m,)) for m in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    stop.set()
    assert results[0] == Generation(1, (0, 1), member=0) and results[1] == Generation(1, (0, 1), member=1)
    assert results[1].rank == 1 and results[1].world_size == 2

    returning = Membership(connect(job_store_port), Generation(0, members, 2), timeout_s=10)
    with pytest.raises(Fenced, match="cut off: the job healed to generation 1 without it"):
        returning.check_fence()
    with pytest.raises(Fenced):
        returning.agree(applied_step=6)  # it arrives after the decision: not a member
    assert Membership(connect(job_store_port), results[0], timeout_s=10).newest() == 1
    steps = Membership(connect(job_store_port), results[0], timeout_s=10).arrived_steps(0)
    assert steps[0] == 6 and steps[1] == 7
