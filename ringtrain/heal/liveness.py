"""Is a member of a --heal job dead? Known for certain, never guessed from a quiet heartbeat.

A heartbeat that stands still is no proof of death: on a loaded machine a Python thread can be kept off the
cores for a second while the process is fine (a full clean-clone test run once evicted a live worker after
0.5 s of silence). Death is a fact the operating system knows at once: the process exited. So every member
registers who it is, its host, pid and start time (``Registration``), and a member counts as dead when:

- it runs on this host, and its pid is gone, is a zombie, or names a younger process (reused); psutil reads
  this from /proc, instantly and without being its parent;
- it runs on another host, and the process watching it there (the launcher that started its agent, or the
  ``ringtrain join`` that started it) wrote ``exited/<host>/<pid>``: ``ExitReporter`` polls pidfds of its
  descendants, so it learns of an exit without reaping anybody (torch's agent reaps its own workers).

Silence is kept for the one thing it can tell, a hang: a member whose heartbeat stood still for
``hang_after_s`` (``dist.timeout_s``, the time a collective waits for it anyway) is taken for lost.

    reg = Registration.mine()
    store.set(f"who/{member}", reg.to_json())
    ...
    Registration.from_json(store.get(f"who/{member}")).alive(exit_recorded)   # True, False, or None (unknown)
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil

from ringtrain.comm.groups import host_id

__all__ = ["Registration", "ExitReporter", "exit_key"]

_START_SLACK_S = 0.05
"""psutil's start times are rounded to the clock tick: a reused pid is one whose start time differs more."""


def exit_key(host: str, pid: int) -> str:
    """The job-level key an ``ExitReporter`` writes when process ``pid`` of ``host`` exited."""
    return f"exited/{host}/{pid}"


def finished_key(host: str, pid: int) -> str:
    """The job-level key a member writes when it ran the job to its end (its process is only exiting now)."""
    return f"finished/{host}/{pid}"


@dataclass(frozen=True)
class Registration:
    """Who a member is, as the operating system knows it."""

    host: str
    """``comm.groups.host_id()``: host name, boot, network namespace (and /dev/shm)."""
    pid: int
    start: float
    """The process's start time (psutil's create_time), which tells a reused pid apart."""

    @classmethod
    def mine(cls) -> Registration:
        return cls(host_id(), os.getpid(), psutil.Process().create_time())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Registration:
        values = json.loads(text)
        return cls(str(values["host"]), int(values["pid"]), float(values["start"]))

    def alive(self, exit_recorded: Callable[[str, int], bool]) -> bool | None:
        """True or False when it can be known here; None when the process runs on another host and no exit
        was recorded for it (it may be alive, or its host may be gone: silence decides then)."""
        if self.host != host_id():
            return False if exit_recorded(self.host, self.pid) else None
        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.start) > _START_SLACK_S:
                return False  # the pid was reused: ours exited
            return process.status() != psutil.STATUS_ZOMBIE  # a stopped (SIGSTOP) process is alive
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return None


class ExitReporter:
    """Watches this process's descendants and records each one's exit in the job store.

    Runs in the processes that start workers: the launcher of a --heal job (its agents' workers are its
    grandchildren) and ``ringtrain join`` (its worker is its child). A descendant is watched through a pidfd
    (Linux 5.3+), which becomes readable when the process exits, before anybody reaps it; nothing here waits
    on a child, so torch's agent keeps reaping its workers itself. Where pidfds are missing it does nothing:
    peers on the same host check pids themselves, and silence covers the rest.

        with ExitReporter(lambda host, pid: store.set(exit_key(host, pid), "1")):
            ...start and wait for the agents...
    """

    def __init__(self, report: Callable[[str, int], None], interval_s: float = 0.05):
        self.report = report
        self.interval_s = interval_s
        self.host = host_id()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringtrain-exit-reporter", daemon=True)

    def __enter__(self) -> ExitReporter:
        if hasattr(os, "pidfd_open"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        poller = select.poll()
        watched: dict[int, int] = {}  # pidfd -> pid
        seen: set[int] = set()
        me = psutil.Process()
        while not self._stopped.is_set():
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                if child.pid in seen:
                    continue
                seen.add(child.pid)
                try:
                    fd = os.pidfd_open(child.pid)
                except OSError:
                    continue  # already gone and reaped: it never ran long enough to be a member
                poller.register(fd, select.POLLIN)
                watched[fd] = child.pid
            for fd, _ in poller.poll(int(self.interval_s * 1000)):
                pid = watched.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                try:
                    self.report(self.host, pid)
                except Exception as err:  # noqa: BLE001 - the store is gone: the job is being torn down
                    print(f"ringtrain: could not record the exit of pid {pid} ({err})", file=sys.stderr, flush=True)
        for fd in watched:
            os.close(fd)
