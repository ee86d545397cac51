"""CommTimer: how long gradient communication takes, and how much of it the step waits for.

DDP hands each gradient bucket to a communication hook as soon as the bucket's gradients are ready, and
backward returns only after every bucket's future has completed. Wrapping the hook gives two numbers:

- ``time/comm_s``: wall time from a bucket's hand-over to the completion of its all-reduce, summed over
  buckets: communication whether or not it overlapped with compute;
- the exposed part: what backward spent on communication instead of compute: the time spent inside hook
  calls (a blocking algorithm runs there; an asynchronous one only launches) plus the wait from the last
  hand-over to the end of backward, when all compute is done and only communication remains. The loop
  books it as the step phase ``comm_exposed``.

    timer = CommTimer()
    ddp.register_comm_hook(process_group, timer.wrap(allreduce_hook))
    loss.backward()
    exposed_s = timer.backward_done()   # after the backward pass that synchronises
    timer.flush()                       # {'time/comm_s': ...} per step
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CommTimer"]

Hook = Callable[[Any, Any], torch.futures.Future]


class CommTimer:
    """Accumulates communication time per optimizer step, averaged over the steps of a logging interval."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        # The clock is a parameter so tests can drive the accounting with a fake one, exactly.
        self._clock = clock
        # Completion callbacks run on the backend's thread.
        self._lock = threading.Lock()
        self._comm_s = 0.0
        self._steps = 0
        self.buckets = 0
        """Gradient buckets handed to communication since the timer was made."""
        self.syncs = 0
        """Completed gradient synchronisations (a bucket marked last, for DDP) since the timer was made."""
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._inside_hooks_s = 0.0
        self._last_return: float | None = None

    def wrap(self, hook: Hook) -> Hook:
        """A DDP communication hook that times ``hook`` and otherwise behaves exactly like it."""

        # No annotations: DDP checks them against dist.GradBucket, and postponed annotations are strings.
        def timed_hook(state, bucket):
            called = self._clock()
            future = hook(state, bucket)
            self.launched(called, last=bucket.is_last())

            def record(done: torch.futures.Future) -> torch.Tensor:
                self.completed(called)
                return done.value()

            return future.then(record)

        timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def launched(self, called: float, last: bool = False) -> None:
        """A bucket's communication was handed over at ``called`` (the timer's clock: perf_counter unless one
        was given) and the call returned now; ``last``: the backward's last bucket (the synchronisation is
        complete once it is)."""
        self.buckets += 1
        self.syncs += last
        returned = self._clock()
        self._inside_hooks_s += returned - called
        self._last_return = returned

    def completed(self, called: float) -> None:
        """The communication handed over at ``called`` has finished (may run on the backend's thread)."""
        elapsed = self._clock() - called
        with self._lock:
            self._comm_s += elapsed

    def backward_done(self) -> float:
        """Call right after a synchronising backward; returns this step's exposed communication (s)."""
        if self._last_return is None:  # no bucket was communicated (e.g. inside no_sync)
            return 0.0
        exposed = self._inside_hooks_s + (self._clock() - self._last_return)
        self._reset_backward()
        return exposed

    def end_step(self) -> None:
        self._steps += 1

    def flush(self) -> dict[str, float]:
        """Per-step means since the last flush."""
        steps = max(1, self._steps)
        with self._lock:
            record = {"time/comm_s": self._comm_s / steps}
            self._comm_s = 0.0
        self._steps = 0
        return record
