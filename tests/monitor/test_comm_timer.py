"""CommTimer: time inside communication hooks and the part of it that backward waits for.

The timer reads a fake clock that only the test moves, and the hooks' futures complete when the test
completes them: every figure below is the accounting's exact answer (times are binary fractions, so the
sums are exact in floating point), whatever the machine's load.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ringtrain.monitor.comm_timer import CommTimer

pytestmark = pytest.mark.unit


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Bucket:
    """What a hook uses of DDP's GradBucket."""

    def __init__(self, last: bool = True):
        self.last = last

    def buffer(self) -> torch.Tensor:
        return torch.ones(4)

    def is_last(self) -> bool:
        return self.last


def blocking_hook(clock: FakeClock, inside_s: float):
    """Reduces inside the call (like a synchronous algorithm) for ``inside_s``, then hands back a finished future."""

    def hook(state, bucket):
        clock.advance(inside_s)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def async_hook(pending: list, launch_s: float = 0.0):
    """Spends ``launch_s`` launching and returns a future the test completes later (like a Gloo work)."""

    def hook(state, bucket):
        clock = pending[0]
        clock.advance(launch_s)
        future = torch.futures.Future()
        pending.append((future, bucket.buffer()))
        return future

    return hook


def test_a_blocking_hook_is_all_exposed():
    clock = FakeClock()
    timer = CommTimer(clock)
    result = timer.wrap(blocking_hook(clock, 0.5))(None, Bucket()).wait()
    clock.advance(0.25)  # the rest of backward after the last bucket returned: compute done, nothing in flight
    exposed = timer.backward_done()
    timer.end_step()
    assert torch.equal(result, torch.ones(4)), "the wrapped hook must return what the hook returns"
    assert exposed == 0.5 + 0.25, "time inside the hook plus the wait after the last hand-over"
    assert timer.flush() == {"time/comm_s": 0.5}


def test_an_asynchronous_hook_is_exposed_from_its_return_to_the_end_of_backward():
    clock = FakeClock()
    timer = CommTimer(clock)
    pending: list = [clock]
    waited = timer.wrap(async_hook(pending, launch_s=0.125))(None, Bucket())
    clock.advance(0.25)
    (future, value), = pending[1:]
    future.set_result(value)  # the all-reduce completes: the timer's callback runs now
    assert torch.equal(waited.wait(), torch.ones(4))
    clock.advance(0.5)  # the end of backward comes later: a wait, with nothing else to do
    exposed = timer.backward_done()
    timer.end_step()
    assert exposed == 0.125 + 0.25 + 0.5
    assert timer.flush() == {"time/comm_s": 0.125 + 0.25}, "from the hand-over to the completion"


def test_communication_overlapped_with_compute_is_not_exposed():
    """Two buckets: the first handed over early and completed while backward still computes, the last one
    handed over when compute is done. Only the last one's launch and the wait after it are exposed; both
    buckets' communication counts in time/comm_s."""
    clock = FakeClock()
    timer = CommTimer(clock)
    pending: list = [clock]
    early = timer.wrap(async_hook(pending))(None, Bucket(last=False))
    clock.advance(1.0)
    pending[1][0].set_result(pending[1][1])  # the first bucket's all-reduce ends during the compute
    clock.advance(1.0)  # backward computes the remaining gradients
    late = timer.wrap(async_hook(pending, launch_s=0.25))(None, Bucket(last=True))
    clock.advance(0.5)
    pending[2][0].set_result(pending[2][1])
    early.wait(), late.wait()
    exposed = timer.backward_done()
    timer.end_step()
    assert exposed == 0.25 + 0.5, "only the last bucket's launch and the wait after it are exposed"
    assert timer.flush() == {"time/comm_s": 1.0 + 0.75}, "both buckets' communication counts in total"
    assert (timer.buckets, timer.syncs) == (2, 1)


def test_each_backward_starts_afresh_and_flush_averages_over_steps():
    clock = FakeClock()
    timer = CommTimer(clock)
    exposed = []
    for inside_s in (0.5, 0.25, 2.0):
        timer.wrap(blocking_hook(clock, inside_s))(None, Bucket()).wait()
        exposed.append(timer.backward_done())
        timer.end_step()
        clock.advance(8.0)  # forward and optimizer of the next step: no communication
    assert exposed == [0.5, 0.25, 2.0], "a backward's exposed time must not carry into the next one"
    assert timer.flush() == {"time/comm_s": (0.5 + 0.25 + 2.0) / 3}
    assert timer.flush() == {"time/comm_s": 0.0}, "a flush starts the next interval at zero"


def test_a_completion_on_the_backend_s_thread_is_counted():
    clock = FakeClock()
    timer = CommTimer(clock)
    pending: list = [clock]
    waited = timer.wrap(async_hook(pending))(None, Bucket())
    clock.advance(0.5)
    thread = threading.Thread(target=pending[1][0].set_result, args=(pending[1][1],))
    thread.start()
    thread.join()
    waited.wait()
    timer.backward_done()
    timer.end_step()
    assert timer.flush() == {"time/comm_s": 0.5}


def test_counts_buckets_and_synchronisations():
    clock = FakeClock()
    timer = CommTimer(clock)
    for last in (False, False, True, False, True):
        timer.wrap(blocking_hook(clock, 0.0))(None, Bucket(last)).wait()
    assert (timer.buckets, timer.syncs) == (5, 2)


def test_no_communication_means_no_exposed_time():
    timer = CommTimer(FakeClock())
    assert timer.backward_done() == 0.0
    timer.end_step()
    assert timer.flush() == {"time/comm_s": 0.0}


def test_the_default_clock_is_the_one_the_strategies_stamp_with():
    """The manual and zero strategies hand ``launched``/``completed`` time.perf_counter() stamps: without a
    clock the timer must read the same clock, or their differences would be meaningless. Bounded by the
    real time that passed around the calls, not by a guess."""
    timer = CommTimer()
    before = time.perf_counter()
    timer.launched(before)
    timer.completed(before)
    exposed = timer.backward_done()
    after = time.perf_counter()
    timer.end_step()
    assert 0.0 <= exposed <= after - before
    assert 0.0 <= timer.flush()["time/comm_s"] <= after - before
