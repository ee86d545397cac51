"""CommTimer: time inside communication hooks and the part of it that backward waits for."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ringtrain.monitor.comm_timer import CommTimer


class Bucket:
    """What a hook uses of DDP's GradBucket."""

    def buffer(self) -> torch.Tensor:
        return torch.ones(4)

    def is_last(self) -> bool:
        return True


def blocking_hook(state, bucket):
    """Reduces inside the call (like a synchronous algorithm), then hands back a finished future."""
    time.sleep(0.03)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def async_hook(state, bucket):
    """Returns at once; the result arrives from another thread later (like a Gloo work)."""
    future = torch.futures.Future()
    threading.Timer(0.03, lambda: future.set_result(bucket.buffer())).start()
    return future


@pytest.mark.parametrize("hook", [blocking_hook, async_hook])
def test_exposed_and_total_time_of_one_bucket(hook):
    timer = CommTimer()
    timed = timer.wrap(hook)
    result = timed(None, Bucket()).wait()  # backward waits for every bucket's future
    exposed = timer.backward_done()
    timer.end_step()
    assert torch.equal(result, torch.ones(4)), "the wrapped hook must return what the hook returns"
    assert 0.025 <= exposed < 1.0
    assert 0.025 <= timer.flush()["time/comm_s"] < 1.0


def delayed_hook(delay_s):
    def hook(state, bucket):
        future = torch.futures.Future()
        threading.Timer(delay_s, lambda: future.set_result(bucket.buffer())).start()
        return future

    return hook


def test_communication_overlapped_with_compute_is_not_exposed():
    timer = CommTimer()
    early = timer.wrap(delayed_hook(0.03))(None, Bucket())  # first bucket ready early in backward
    time.sleep(0.06)  # backward computes the remaining gradients meanwhile
    late = timer.wrap(delayed_hook(0.01))(None, Bucket())  # the last bucket, when compute is done
    early.wait()
    late.wait()
    exposed = timer.backward_done()
    timer.end_step()
    assert 0.008 <= exposed < 0.03, "only the last bucket's wait is exposed"
    assert 0.035 <= timer.flush()["time/comm_s"] < 0.5, "both buckets' communication counts in total"


def test_counts_buckets_and_synchronisations():
    timer = CommTimer()
    for _ in range(3):
        timer.wrap(blocking_hook)(None, Bucket()).wait()
    assert (timer.buckets, timer.syncs) == (3, 3)


def test_no_communication_means_no_exposed_time():
    timer = CommTimer()
    assert timer.backward_done() == 0.0
    timer.end_step()
    assert timer.flush() == {"time/comm_s": 0.0}
