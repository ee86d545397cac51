"""The --heal launcher's verdict (elastic._wait): a worker that leaves a broken replica exits 0 (Spared) before the
job ends, so an exit 0 alone does not make the job a success; the job's "done" mark (rank 0 ran it to its end)
does. Real child processes stand for the agents; the watch is a stand-in for the job store."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringtrain.elastic import _wait
from ringtrain.launch import WorkerFailed

pytestmark = pytest.mark.job


class _Exits:
    """An agent: a real process exiting with ``code``, described as elastic._Agent describes one."""

    def __init__(self, index: int, code: int):
        self.index = index
        self.process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])

    def finish(self) -> int:
        return self.process.wait()

    def describe_exit(self, code: int) -> str:
        return f"worker agent {self.index} (pid {self.process.pid}) exited with code {code}"


class _Watch:
    def __init__(self, done: bool | None):
        self.done = done  # None: the store is gone

    def job_done(self) -> bool:
        return bool(self.done)

    def job_done_or_unknown(self) -> bool:
        return True if self.done is None else self.done

    def job_started(self) -> bool:
        return True

    def holds_unfinished_worker(self, agent_pid: int) -> bool:
        return False


def test_a_spared_worker_s_exit_0_does_not_make_a_job_that_never_finished_a_success():
    agents = [_Exits(0, 0), _Exits(1, 1), _Exits(2, 1)]  # the spared peer, then the two survivors failing
    with pytest.raises(WorkerFailed, match=r"worker agent 1 .* exited with code 1 \(and 1 other agent failed\)"):
        _wait(agents, 1, _Watch(done=False), signals=())


def test_every_worker_spared_and_none_finishing_is_one_line():
    with pytest.raises(WorkerFailed, match="every worker left the job before its end"):
        _wait([_Exits(0, 0), _Exits(1, 0)], 1, _Watch(done=False), signals=())


@pytest.mark.parametrize("done", [True, None], ids=["done", "store-gone"])
def test_a_job_that_ran_to_its_end_succeeds_beside_lost_workers(done):
    _wait([_Exits(0, 0), _Exits(1, -9), _Exits(2, 0)], 1, _Watch(done=done), signals=())


def test_without_heal_the_exit_codes_decide():
    _wait([_Exits(0, 0), _Exits(1, 1)], 1, None, signals=())
    with pytest.raises(WorkerFailed, match="worker agent 0"):
        _wait([_Exits(0, 1)], 1, None, signals=())
