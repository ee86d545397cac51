"""The run directory's writer lock (ringtrain/train/run_lock.py): a finished writer leaves no ``.lock`` behind, and
a writer that waited for it holds the file that is at the path, so a third one waits for it in turn (flock
conflicts between two open files of one process too, so threads stand in for the processes)."""

from __future__ import annotations

import os
import threading

import pytest

from ringtrain.errors import ConfigError
from ringtrain.train.run_lock import RunDirLock

pytestmark = pytest.mark.unit


def test_a_finished_writer_leaves_no_lock_file(tmp_path):
    with RunDirLock(tmp_path) as lock:
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")
        assert lock.locked
    assert not (tmp_path / ".lock").exists()


def test_a_writer_that_failed_or_was_fenced_leaves_the_file_as_a_killed_one_does(tmp_path):
    """A fenced writer (cut off by a heal: the run directory is another writer's now) must write nothing there,
    removing the lock file included (tests/heal/test_heal.py's stopped rank 0 caught it)."""
    with pytest.raises(RuntimeError), RunDirLock(tmp_path):
        raise RuntimeError("fenced")
    assert (tmp_path / ".lock").exists()


def test_a_writer_that_waited_holds_the_file_at_the_path_and_a_third_waits_for_it(tmp_path):
    first = RunDirLock(tmp_path).__enter__()
    second = RunDirLock(tmp_path, timeout_s=60)
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: (second.__enter__(), entered.set()))
    waiter.start()
    assert not entered.wait(0.5)  # the first holds it
    first.__exit__(None, None, None)  # removes the file as it lets go
    waiter.join()
    assert entered.is_set()
    # The second holds the file now at the path (it opened it again), not the removed one.
    assert os.path.samestat(os.fstat(second.fd), os.stat(tmp_path / ".lock"))
    with pytest.raises(ConfigError, match="is in use by another training process"):
        RunDirLock(tmp_path, timeout_s=0.3).__enter__()
    second.__exit__(None, None, None)
    assert not (tmp_path / ".lock").exists()
