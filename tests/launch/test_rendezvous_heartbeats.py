"""A launcher stopped by a signal ends on ringtrain's line only: the rendezvous handler's keep-alive thread,
which torch's launcher leaves running after a signal, is stopped by ``rendezvous.stop_heartbeats`` (launch.py
calls it as the launch ends). Without it, a handler whose last reference went while its thread was beating
was finalized on that thread, which then tried to join itself: ``Exception ignored in: <finalize ...>``,
``RuntimeError: cannot join current thread`` after "stopped at step N" (CI, test_quiet_stop[run])."""

from __future__ import annotations

import gc
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

from ringtrain.group import rendezvous
from ringtrain.group.auth import SECRET_VAR, JobSecret

pytestmark = pytest.mark.unit


def test_a_handler_dropped_while_its_heartbeat_is_in_flight_ends_quietly(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv(SECRET_VAR, JobSecret.new().hex)
    rendezvous.register()
    params = RendezvousParameters(rendezvous.BACKEND, f"127.0.0.1:{server.port}", "job", 1, 1,
                                  keep_alive_interval=1, last_call_timeout=1, join_timeout=10)
    handler = rendezvous_handler_registry.create_handler(params)
    handler.next_rendezvous()  # starts the keep-alive thread, as the agent's first round does
    beating, release = threading.Event(), threading.Event()

    def slow_beat() -> None:  # holds no reference to the handler: the thread's own is the last one
        beating.set()
        release.wait(10)

    handler._keep_alive = slow_beat
    thread = next(t for t in threading.enumerate() if t.name.startswith("RendezvousKeepAliveTimer"))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    assert beating.wait(10), "the keep-alive thread never beat"
    rendezvous.stop_heartbeats()  # what launch() does as it ends, whichever way it ends
    del handler  # the launcher lets go of it (a signal's traceback freed); the beating thread still holds it
    gc.collect()
    release.set()  # the beat ends on the thread, which drops the last reference there
    thread.join(10)
    assert not thread.is_alive(), "the keep-alive thread did not stop"
    time.sleep(0.1)  # a finalizer's failure is reported as the object goes, on that thread
    assert [f"{hook.exc_type.__name__}: {hook.exc_value}" for hook in unraisable] == []
