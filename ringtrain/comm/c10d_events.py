"""The profiler events of the ``ringtrain_shm`` c10d backend's calls, shaped as c10d's own.

c10d's backends record one event per call, ``gloo:all_reduce`` for Gloo, when the work is made, with the input
tensors (so the profiler has their shapes), and end it when the work completes, on whichever thread completes it:
torch marks such events asynchronous, keeps them off the caller's stack, and its own c10d tests
(``call_dist_op``) ask for exactly that: one ``<backend>:<op>`` event a call, asynchronous, with the inputs'
shapes. ``ringtrain_shm`` records ``ringtrain_shm:<op>`` the same way, for the calls it runs on shared memory and
for those it hands to Gloo (whose own ``gloo:<op>`` event then lies inside)::

    handle = c10d_events.begin("all_reduce", [tensor])   # None unless a profiler is on: nothing to pay then
    ...                                                    # the collective
    c10d_events.end(handle)
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

__all__ = ["begin", "end", "ProfiledWork"]


def begin(op: str, tensors) -> object | None:
    """Start the event ``ringtrain_shm:<op>`` with ``tensors`` as its inputs; None when no profiler is on."""
    if not torch._C._autograd._profiler_enabled():
        return None
    return torch.autograd._record_function_with_args_enter(f"ringtrain_shm:{op}", *tensors)


def end(handle: object | None) -> None:
    """End an event ``begin`` started (None: nothing). It is ended on another thread, as c10d's Work ends its event
    where the work completes: that is what makes the profiler call it asynchronous. Waited for, so that the event
    is closed before the caller goes on (and before a profile that is about to stop). A thread a call, made only
    while profiling: nothing to carry across a fork, as a pool's threads would be."""
    if handle is None:
        return
    ender = threading.Thread(target=torch.autograd._record_function_with_args_exit, args=(handle,),
                             name="ringtrain_shm-profiler-event")
    ender.start()
    ender.join()


class ProfiledWork(dist.Work):
    """A Gloo work whose ``ringtrain_shm:<op>`` event ends when it is waited on (or its future completes)."""

    def __init__(self, work: dist.Work, handle: object):
        super().__init__()
        self._work, self._handle = work, handle
        self._lock = threading.Lock()

    def _end(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        end(handle)

    def wait(self, timeout=None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._end()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._work.result()

    def _source_rank(self) -> int:
        return self._work._source_rank()

    def get_future(self):
        def ended(future):
            self._end()
            return future.value()

        return self._work.get_future().then(ended)
