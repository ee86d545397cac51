"""CommQueue: one thread that runs a rank's collectives in the order they were handed over, so that the
main thread computes while they run (zero3's prefetch), as a CUDA communication stream does for NCCL.

Every rank hands over the same collectives in the same order (the model's hooks fire in the same order), and
one thread runs them first in, first out: the ranks meet in every collective in that order, whatever the
algorithm (Gloo's, ringtrain's ring or shm). Nothing else may use the process group while work is queued:
the owner drains the queue at the end of each forward and backward pass.

The timer books each collective's time from hand-over to completion as communication, and the time the
main thread waits for one (``wait``, ``drain``) as exposed communication.

    queue = CommQueue(comm_timer)
    gathered = queue.submit(lambda: comm.all_gather(flat, "shm", group))   # returns at once
    ...                                                                    # compute meanwhile
    queue.wait(gathered)                                                   # flat is complete
    queue.drain()                                                          # nothing in flight
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ringtrain.monitor.comm_timer import CommTimer

__all__ = ["CommQueue"]


class CommQueue:
    """Collectives run one at a time on a thread of their own, in hand-over order."""

    def __init__(self, timer: CommTimer):
        self.timer = timer
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, call: Callable[[], Any]) -> Future:
        """Queue ``call`` (a collective, and what must follow it before anyone reads its result)."""
        if self._executor is None:  # started on first use: a rank that never prefetches has no thread
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtrain-comm")
        submitted = time.perf_counter()

        def run() -> Any:
            try:
                return call()
            finally:
                self.timer.completed(submitted)

        future = self._executor.submit(run)
        self._pending = [f for f in self._pending if not f.done()] + [future]
        return future

    def wait(self, future: Future) -> Any:
        """The result of ``future`` (its error, raised here); the wait is booked as exposed communication."""
        started = time.perf_counter()
        try:
            return future.result()
        finally:
            self.timer.launched(started)

    def drain(self) -> None:
        """Wait for everything queued (the first error is raised here)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        started = time.perf_counter()
        try:
            for future in pending:
                future.result()
        finally:
            self.timer.launched(started)

    def close(self) -> None:
        """Let the thread end (after the queued work)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
