"""heal/membership.py's agreement on a real TCPStore: the survivors agree on the same next generation, a silent
member is left out, and a member that comes back after the decision is fenced (it must write nothing)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ringtrain.heal.membership import Fenced, Generation, Membership
from ringtrain.group.jobstore import JobStore


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


@pytest.mark.unit
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
                                hang_after_s=0.3)
        membership.publish_failure(step=7)
        results[member], _ = membership.agree(applied_step=6 + member % 2)

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


class StaleFirstAnswer:
    """The store as a worker stopped inside its fence read sees it: the first answer was sent (generation 0),
    then the job healed (generation 1) while the worker was stopped, and the old answer is read on resuming."""

    def __init__(self, store):
        self.store, self.stale = store, True

    def check(self, keys):
        return self.store.check(keys)

    def get(self, key):
        answer = self.store.get(key)
        if self.stale:
            self.stale = False
            self.store.set("generation", "1")  # the survivors' heal, while this worker is stopped
            time.sleep(0.7)
        return answer


@pytest.mark.unit
def test_a_fence_read_that_took_long_is_read_again_so_a_stopped_worker_does_not_act_on_a_stale_answer(
        job_store_port):
    membership = Membership(connect(job_store_port), Generation(0, (0, 1), member=0), timeout_s=10)
    membership.store.set("generation", "0")
    membership.check_fence()  # quick and current: passes
    membership.store = StaleFirstAnswer(membership.store)
    with pytest.raises(Fenced, match="cut off: the job healed to generation 1 without it"):
        membership.check_fence()  # the stale "0" took 0.7 s to arrive: read again, and it is "1"


@pytest.mark.unit
def test_a_writer_still_writing_the_step_before_an_admission_is_not_cut_off_but_one_left_out_later_is(job_store_port):
    # Generation 1 = members 0 and 2. Member 2 reaches the planned boundary first and admits joiner 1001
    # (generation 2), while member 0, the writer, is still writing the step before it: its fence check reads
    # generation 2 and must let it write, since it is one of generation 2's members.
    writer = Membership(connect(job_store_port), Generation(1, (0, 2), member=0), timeout_s=10)
    other = Membership(connect(job_store_port), Generation(1, (0, 2), member=2), timeout_s=10)
    assert other.admit([1001]) == Generation(2, (0, 2, 1001), member=2)
    assert writer.newest() == 2
    writer.check_fence()  # behind, not cut off
    assert writer.admit([1001]) == Generation(2, (0, 2, 1001), member=0)  # then it reaches the boundary too
    # Generation 2 then fails and the others agree without member 0 (it never arrived): now it is cut off,
    # from its own generation 2 and from the generation 1 it would have been in had it not reached the boundary.
    other.publish_failure(step=9)
    joiner = Membership(connect(job_store_port), Generation(2, (0, 2, 1001), member=1001), timeout_s=0.3)
    other.timeout_s = 0.3
    threads = [threading.Thread(target=m.agree, kwargs={"applied_step": 8}) for m in (other, joiner)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert other.generation == Generation(3, (2, 1001), member=2)
    with pytest.raises(Fenced, match="healed to generation 3 without it"):
        writer.check_fence()
    behind = Membership(connect(job_store_port), Generation(1, (0, 2), member=0), timeout_s=10)
    with pytest.raises(Fenced, match="healed to generation 3 without it"):
        behind.check_fence()


@pytest.mark.unit
def test_a_new_writer_takes_the_run_files_over_so_an_old_writers_open_handle_writes_nowhere(tmp_path):
    from ringtrain.monitor.loggers import RunDirLogger
    from ringtrain.monitor.sinks import CsvLogger

    record = {"type": "train", "step": 1, "loss": 0.5}
    old_run, old_csv = RunDirLogger(tmp_path), CsvLogger(tmp_path / "metrics.csv")
    for logger in (old_run, old_csv):
        logger.start(10, 0, 5)
        logger.log(record)
    new_run, new_csv = RunDirLogger(tmp_path), CsvLogger(tmp_path / "metrics.csv")
    for logger in (new_run, new_csv):
        logger.start(10, 1, 5)  # a heal's new rank 0 taking over the run directory
    before = {name: (tmp_path / name).read_text() for name in ("metrics.jsonl", "metrics.csv")}
    assert json.loads(before["metrics.jsonl"]) == record and before["metrics.csv"].count("\n") == 2
    for logger in (old_run, old_csv):
        logger.log({**record, "step": 2})  # the cut-off writer's append, after its fence check passed
    assert {name: (tmp_path / name).read_text() for name in before} == before
    for logger in (new_run, new_csv):
        logger.log({**record, "step": 3})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 3
    for logger in (old_run, old_csv, new_run, new_csv):
        logger.close()


def registered(store: JobStore, member: int, pid: int) -> None:
    """Register ``member`` as process ``pid`` of this host (its start time read as a member reads its own)."""
    import psutil

    from ringtrain.heal.liveness import Registration
    from ringtrain.comm.groups import host_id

    registration = Registration(host_id(), pid, psutil.Process(pid).create_time())
    dist.PrefixStore("heal/0/", store.store).set(f"who/{member}", registration.to_json())


@pytest.mark.job
def test_a_live_member_whose_heartbeat_is_starved_is_waited_for_and_a_dead_one_is_not(job_store_port):
    """Issue 21 item 10: a heartbeat that stands still is no proof of death. Member 1 is alive (a process of
    this host) but its heartbeat thread is starved for 1.5 s, three times the old 0.5 s rule: the survivors
    wait for it, and it is in the next generation when it arrives. Member 2 beat a moment ago, but its process
    has exited: it is left out at once, without waiting for any silence."""
    import subprocess
    import sys

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid = dead.pid
    try:
        registered(connect(job_store_port), 1, alive.pid)
        registered(connect(job_store_port), 2, dead_pid)
        dead.wait()
        connect(job_store_port).beat(1, 1)  # then nothing for 1.5 s: the thread is starved, not dead
        connect(job_store_port).beat(2, 1)
        results: dict[int, Generation] = {}
        members = (0, 1, 2)

        def arrive(member: int, after_s: float) -> None:
            time.sleep(after_s)
            membership = Membership(connect(job_store_port), Generation(0, members, member), timeout_s=20)
            results[member], _ = membership.agree(applied_step=5)

        started = time.monotonic()
        threads = [threading.Thread(target=arrive, args=(0, 0.0)), threading.Thread(target=arrive, args=(1, 1.5))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        took = time.monotonic() - started
    finally:
        alive.kill()
        alive.wait()
    print(f"agreed in {took:.2f} s: {results}")
    assert results[0] == Generation(1, (0, 1), member=0) and results[1] == Generation(1, (0, 1), member=1)
    assert took < 10, took  # the dead member cost no hang_after_s (20 s) of waiting


@pytest.mark.unit
def test_a_hung_member_is_left_out_after_hang_after_s_and_a_withdrawn_joiner_at_once(job_store_port):
    """Silence still ends a hang: a member whose heartbeat stood still hang_after_s is taken for lost. A joiner
    that withdrew its request (it left) is lost at once."""
    members = (0, 1, 1001)
    store = connect(job_store_port)
    store.beat(1, 1)
    dist.PrefixStore("heal/0/", store.store).set("join/withdrawn/1001", "1")
    started = time.monotonic()
    membership = Membership(connect(job_store_port), Generation(0, members, 0), timeout_s=20, hang_after_s=1.0)
    generation, finished = membership.agree(applied_step=3)
    took = time.monotonic() - started
    assert generation == Generation(1, (0,), member=0) and not finished
    assert 0.9 <= took < 10, took


@pytest.mark.unit
def test_after_a_heal_the_watch_reads_each_ranks_heartbeat_and_host_under_its_member_id(job_store_port):
    """Under --heal every worker beats and records its host under its member id (its first rank, or 1000 + n);
    after a heal ranks and ids differ (here members 0, 2 and 1001 are ranks 0, 1, 2). The watch must read
    rank 1's host and heartbeat under id 2, not under id 1 (a worker lost long ago)."""
    from ringtrain.group.watch import CollectiveWatch

    store = connect(job_store_port)
    for member, address in ((0, "198.18.0.1"), (1, "198.18.0.9"), (2, "198.18.0.2"), (1001, "198.18.0.3")):
        store.set_host(member, address)
    watch = CollectiveWatch(store, rank=0, world_size=3, timeout_s=5, interval_s=0.05, members=[0, 2, 1001])
    assert watch._hosts() == {0: "198.18.0.1", 1: "198.18.0.2", 2: "198.18.0.3"}
    store.beat(0, 1), store.beat(2, 1), store.beat(1001, 1)
    stop = threading.Event()
    beater = threading.Thread(target=beat_while, args=(connect(job_store_port), 1001, stop), daemon=True)
    beater.start()
    try:
        assert watch.silent_ranks() == [1]  # member 2 (rank 1) stood still; member 1001 (rank 2) beats
    finally:
        stop.set()


@pytest.mark.job
def test_a_member_on_another_host_is_dead_once_the_process_that_started_it_records_its_exit(job_store_port,
                                                                                             monkeypatch):
    """Across hosts nobody can read a peer's /proc: the process that started the worker (the launcher, or
    `ringtrain join`) watches it through a pidfd and records its exit in the job store, and the members read
    that. Here this test process starts a child under an ExitReporter; seen from a member on another host
    (host_id patched), the child is alive until it is killed, and dead once the reporter recorded it."""
    import subprocess
    import sys

    from ringtrain.heal import liveness
    from ringtrain.heal.liveness import ExitReporter, exit_key
    from ringtrain.heal.membership import job_keys

    reports = job_keys(connect(job_store_port))
    with ExitReporter(lambda host, pid: reports.set(exit_key(host, pid), "1"), interval_s=0.02):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            registered(connect(job_store_port), 5, child.pid)
            membership = Membership(connect(job_store_port), Generation(0, (0, 5), 0), timeout_s=10)
            time.sleep(0.3)  # the reporter found its new descendant
            monkeypatch.setattr(liveness, "host_id", lambda: "another-host/boot/net:1/shm:1")
            assert not membership.dead(5)  # another host, no exit recorded: not known to be dead
            child.kill()
            child.wait()
            deadline = time.monotonic() + 5
            while not membership.dead(5) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert membership.dead(5)
        finally:
            child.kill()
            child.wait()


@pytest.mark.job
def test_ctrl_c_before_admission_is_an_interruption_even_when_the_job_store_is_gone():
    """`ringtrain join` interrupted (Ctrl-C) while it waits for admission withdraws its request; when the job's
    store has already gone (the job ended meanwhile) the withdrawal fails, and the interruption is still what
    the user did: JoinInterrupted (exit 130), not HealFailed ("the job ended", exit 1)."""
    import subprocess
    import sys

    from ringtrain.heal.membership import JoinInterrupted, request_join

    host = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as dist; from datetime import "
                             "timedelta; s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
                             "timeout=timedelta(seconds=10)); print(s.port, flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        store = connect(int(host.stdout.readline()))
        store.store.set("heal/current", "0")

        def job_ends_then_ctrl_c(member: int) -> None:
            host.kill()
            host.wait()
            raise KeyboardInterrupt

        with pytest.raises(JoinInterrupted, match="interrupted before the job admitted member 1001 .the job had ended"):
            request_join(store, timeout_s=5, wait_s=30, on_member=job_ends_then_ctrl_c)
    finally:
        host.kill()
        host.wait()
