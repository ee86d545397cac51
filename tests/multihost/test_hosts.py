"""The test hosts themselves: separate stacks, reachable from each other only, capped, cut, removed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.hosts import INTERFACE, Hosts, namespaces, sweep_stale

pytestmark = pytest.mark.hosts

_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("open")
except ConnectionRefusedError:
    print("refused")        # the host answered: nothing listens there
except OSError as err:
    print(type(err).__name__, err.errno)
"""


def _probe(hosts: Hosts, i: int, address: str, port: int = 9, timeout_s: float = 1.0) -> str:
    out = hosts.run(i, [sys.executable, "-c", _PROBE, address, str(port), str(timeout_s)],
                    capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or out.stderr.strip()


def test_hosts_reach_each_other_and_nothing_else(make_hosts):
    hosts = make_hosts(2)
    routes = hosts.run(0, ["ip", "route"], capture_output=True, text=True).stdout
    assert "default" not in routes and f"dev {INTERFACE}" in routes, routes
    assert _probe(hosts, 0, hosts.addr(1)) == "refused"  # host 1 answers (no listener): the link works
    # Off the hosts' /24 (still in the benchmark range): network unreachable, nothing is even sent.
    assert _probe(hosts, 1, "198.19.0.1").startswith("OSError 101")
    hosts.cut(1)
    assert _probe(hosts, 0, hosts.addr(1)) in ("TimeoutError None", "OSError 113")  # silence or no neighbour
    hosts.restore(1)
    for _ in range(5):  # a failed neighbour entry may answer 'no route' once more
        if _probe(hosts, 0, hosts.addr(1)) == "refused":
            break
    else:
        raise AssertionError("host 1 unreachable after restore")


def test_rate_cap_and_teardown(make_hosts):
    hosts = make_hosts(2, rate="100mbit")
    qdisc = hosts.run(1, ["tc", "qdisc", "show", "dev", INTERFACE], capture_output=True, text=True).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
    hosts.down()
    assert not any(name.startswith(f"rt-{hosts.owner}-") for name in namespaces())


def test_sweep_removes_hosts_of_a_killed_run(make_hosts):
    make_hosts(1)  # skips without root
    child = subprocess.run([sys.executable, "-c", "import os, tests.hosts as h; h.Hosts.up(1); print(os.getpid()); os._exit(9)"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    owner = f"rt-p{child.stdout.strip()}-"
    assert any(name.startswith(owner) for name in namespaces()), child.stderr
    sweep_stale()
    assert not any(name.startswith(owner) for name in namespaces())
