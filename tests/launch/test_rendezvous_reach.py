"""reach_rendezvous: a node that starts before node 0's launcher waits for it; an address pair that can never meet
fails at once in one line. All traffic stays on this machine (loopback and this machine's own address)."""

from __future__ import annotations

import socket
import threading
import time

import psutil
import pytest

from ringtrain.errors import LaunchError
from ringtrain.group.addresses import _loopback_cannot_reach, reach_rendezvous

pytestmark = pytest.mark.unit


def _own_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _listen_later(host: str, port: int, delay_s: float, stop: threading.Event) -> threading.Thread:
    def serve() -> None:
        time.sleep(delay_s)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((host, port))
            server.listen()
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    server.accept()[0].close()
                except TimeoutError:
                    pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_from_loopback_a_node_waits_for_node_0_listening_later_on_this_machines_own_address():
    """The CI failure of 2026-12-07: node 1 at 127.0.0.1 was refused by node 0's endpoint (this machine's other
    address) before node 0's launcher listened, took the refusal for 'loopback cannot reach it' and quit."""
    own = _own_address()
    if own is None:
        pytest.skip("this machine has no address besides loopback")
    port, stop = _free_port(own), threading.Event()
    server = _listen_later(own, port, 1.5, stop)
    try:
        started = time.monotonic()
        assert reach_rendezvous(own, port, "127.0.0.1", 30) == "127.0.0.1"
        assert time.monotonic() - started >= 1.0  # it was refused first, and waited
    finally:
        stop.set()
        server.join(5)


def test_a_refused_endpoint_is_retried_until_the_wait_ends_then_named_in_one_line():
    port = _free_port("127.0.0.1")
    started = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rendezvous 127.0.0.1:{port} did not answer within 1 s .*node 0's launcher"):
        reach_rendezvous("127.0.0.1", port, None, 1)
    assert time.monotonic() - started >= 0.9


def test_loopback_and_another_machine_never_meet():
    # Decided without a packet: 198.18.0.1 (a test-network address) is not on this machine.
    assert _loopback_cannot_reach("127.0.0.1", "198.18.0.1")
    assert not _loopback_cannot_reach(None, "198.18.0.1")
    assert not _loopback_cannot_reach("127.0.0.1", "127.0.0.1")
    own = _own_address()
    if own is not None:
        assert not _loopback_cannot_reach("127.0.0.1", own)
        assert not _loopback_cannot_reach(own, "127.0.0.1")
