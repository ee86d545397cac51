"""Test hosts on one machine: Linux network namespaces joined by veth pairs and a bridge.

Each host is a network namespace with its own network stack: loopback up, one interface ``veth0`` with the
address ``198.18.0.(i+1)/24`` (198.18.0.0/15 is reserved for network benchmarks) and no default route, so
nothing in it can reach anything but the other test hosts. Every host's veth pair ends in one bridge, which
lives in a namespace of its own: the machine's own network (its root namespace) is not touched at all. A
``tbf`` rate cap on both ends of a host's pair makes its link a full-duplex link of that rate; ``cut`` and
``restore`` take it down and up (``ip link set ... down``). Namespaces share the machine's host name,
``/dev/shm`` and processes' view of each other; only the network differs.

    with Hosts.up(2, rate="1gbit") as hosts:
        hosts.popen(1, ["python", "-m", "ringtrain", "train", ..., "--local-addr", hosts.addr(1)])
        hosts.cut(1)        # host 1's link goes down
        hosts.restore(1)

Names are scoped to the run that made them (``rt-p<pid>-h0``, ``rt-p<pid>-br``): a run removes its own on
the way out, and every ``Hosts.up`` first sweeps the names of runs whose process is gone (a killed test).
For people: ``python -m ringtrain.testing.hosts up 2 --rate 1gbit`` (names ``rt-cli-*``) and ``python -m ringtrain.testing.hosts down``.
Needs root and ``ip netns``; ``unavailable()`` says in one line why not, for a skip.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Hosts", "HostsError", "unavailable", "sweep_stale", "listening_sockets", "INTERFACE", "SUBNET"]

SUBNET = "198.18.0"
"""Hosts get SUBNET.1, SUBNET.2, ... /24; nothing in the namespaces routes anywhere else."""
INTERFACE = "veth0"
"""Each host's one interface (the same name in every namespace: names are per namespace)."""
_PREFIX = "rt-"
_NAME = re.compile(r"^rt-(p(\d+)|cli)-(h\d+|br)$")
_MAX_HOSTS = 200


class HostsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _in(namespace: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostsError(f"in {namespace}: {' '.join(command)}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """None when namespaces can be made here, else one line saying why not (for a test's skip)."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (ip netns, veth, bridge); run the multi-host tests as root"
    try:
        _ip("netns", "list")
    except (OSError, HostsError) as err:
        return f"test hosts need the `ip` command with netns support: {err}"
    return None


def namespaces() -> list[str]:
    """Every namespace name this module could have made (any run's)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and _NAME.match(line.split()[0])]


def sweep_stale() -> list[str]:
    """Remove the namespaces of test runs whose process is gone (a killed or crashed run); return them."""
    removed = []
    for name in namespaces():
        owner = _NAME.match(name).group(2)
        if owner is not None and not os.path.exists(f"/proc/{owner}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Hosts:
    """``count`` test hosts; ``Hosts.up`` makes them, ``down`` (or leaving the ``with``) removes them."""

    count: int
    owner: str
    rate: str | None = None
    made: list[str] = field(default_factory=list)

    # --- naming -----------------------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{_PREFIX}{self.owner}-br"

    def ns(self, i: int) -> str:
        """Namespace name of host i."""
        return f"{_PREFIX}{self.owner}-h{i}"

    def addr(self, i: int) -> str:
        """Address of host i: 198.18.0.(i+1)."""
        return f"{SUBNET}.{i + 1}"

    def add_address(self, i: int, address: str) -> None:
        """Give host i's interface one more address (/24), listed after the ones it has: an interface's first
        address is what a choice by interface name (GLOO_SOCKET_IFNAME) gets."""
        _ip("-n", self.ns(i), "addr", "add", f"{address}/24", "dev", INTERFACE)

    def exec_prefix(self, i: int) -> list[str]:
        """Put this in front of a command to run it on host i."""
        return ["ip", "netns", "exec", self.ns(i)]

    # --- lifetime ---------------------------------------------------------------------------------
    @classmethod
    def up(cls, count: int, rate: str | None = None, owner: str | None = None) -> Hosts:
        if not 1 <= count <= _MAX_HOSTS:
            raise HostsError(f"count must be in [1, {_MAX_HOSTS}], got {count}")
        reason = unavailable()
        if reason:
            raise HostsError(reason)
        sweep_stale()
        hosts = cls(count, owner or f"p{os.getpid()}", rate)
        try:
            hosts._build()
        except BaseException:
            hosts.down()
            raise
        return hosts

    def _build(self) -> None:
        for name in [self.bridge, *(self.ns(i) for i in range(self.count))]:
            if name in namespaces():
                raise HostsError(f"namespace {name} exists already; remove it with `python -m ringtrain.testing.hosts down`")
        _ip("netns", "add", self.bridge)
        self.made.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i in range(self.count):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # IPv4 only: no IPv6 link-local chatter (router solicitations) on the bridge.
            _in(ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", check=False)
            # Both ends are made inside the bridge's namespace, one is moved to the host's: the machine's
            # own namespace never holds an interface of ours, not even for a moment.
            _ip("-n", self.bridge, "link", "add", f"h{i}", "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            _ip("-n", self.bridge, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
        if self.rate:
            self.set_rate(self.rate)

    def down(self) -> None:
        """Remove every namespace of this set (their interfaces go with them). Kill processes in them first:
        a namespace with a process in it lives on, nameless, until the process ends."""
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # --- links ------------------------------------------------------------------------------------
    def set_rate(self, rate: str | None) -> None:
        """Cap every host's link at ``rate`` (tc's units: 1gbit, 100mbit) in both directions; None: no cap."""
        for i in range(self.count):
            for ns, dev in ((self.ns(i), INTERFACE), (self.bridge, f"h{i}")):
                if rate is None:
                    _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                    continue
                # burst: 2 ms at the rate (at least 32 KB), so the token bucket refills between timer ticks.
                burst = max(32 << 10, _rate_bytes_per_s(rate) // 500)
                _in(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", str(burst), "latency", "50ms")
        self.rate = rate

    def cut(self, i: int) -> None:
        """Take host i's link down at the bridge (a dead switch port): the host keeps its address and route,
        and what it sends, or is sent, goes nowhere. Peers see silence, not an error."""
        _ip("-n", self.bridge, "link", "set", f"h{i}", "down")

    def restore(self, i: int) -> None:
        """Bring host i's link back up (its address and rate cap stay)."""
        _ip("-n", self.bridge, "link", "set", f"h{i}", "up")

    # --- processes --------------------------------------------------------------------------------
    def popen(self, i: int, command: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` on host i."""
        return subprocess.Popen([*self.exec_prefix(i), *command], **kwargs)

    def run(self, i: int, command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``command`` on host i to the end."""
        return subprocess.run([*self.exec_prefix(i), *command], **kwargs)


def listening_sockets(pid: int, own: bool = False, netns: str | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the network namespace of process ``pid`` (any
    process's: a test host's stack holds only the sockets of what runs there). Empty if the process is gone.

    ``own``: only the sockets process ``pid`` holds open (its descriptors' socket inodes). Read from
    ``/proc/<pid>``, the process's own view of its namespace, so it works from outside the namespace, where
    psutil's ``net_connections`` (which reads the caller's ``/proc/net``) sees none of them.

    ``netns``: the namespace (its name under ``ip netns``) the process must be in; empty while it is not.
    ``ip netns exec NS cmd`` is in the caller's namespace until it has entered NS: a sample taken then read
    this machine's own listeners (CI, under load: 0.0.0.0 and other tests' 127.0.0.1 stores)."""
    if netns is not None and not _in_netns(pid, netns):
        return set()
    inodes = _socket_inodes(pid) if own else None
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state != "0A":  # LISTEN
                continue
            if inodes is not None and fields[9] not in inodes:
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def _in_netns(pid: int, netns: str) -> bool:
    """Whether process ``pid`` is in namespace ``netns`` (``ip netns`` keeps each one's handle in /run/netns)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return False


def _socket_inodes(pid: int) -> set[str]:
    """The inodes (as /proc/net prints them) of the sockets process ``pid`` holds open."""
    inodes = set()
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue  # closed while listing
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _rate_bytes_per_s(rate: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not match:
        raise HostsError(f"rate {rate!r}: write it as tc does, e.g. 1gbit or 100mbit")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return int(value / 8 if match.group(3) == "bit" else value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.testing.hosts", description="Test hosts in network namespaces.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make N hosts (rt-cli-h0..), addresses 198.18.0.1..N, one bridge")
    up.add_argument("count", type=int)
    up.add_argument("--rate", help="cap each host's link, e.g. 1gbit or 100mbit (tc tbf)")
    commands.add_parser("down", help="remove the hosts `up` made, and stale ones of killed test runs")
    cut = commands.add_parser("cut", help="take host I's link down")
    cut.add_argument("host", type=int)
    restore = commands.add_parser("restore", help="bring host I's link back up")
    restore.add_argument("host", type=int)
    args = parser.parse_args(argv)
    try:
        existing = sorted(n for n in namespaces() if n.startswith(f"{_PREFIX}cli-h"))
        hosts = Hosts(len(existing), "cli", made=[f"{_PREFIX}cli-br", *existing])
        if args.command == "up":
            hosts = Hosts.up(args.count, args.rate, owner="cli")
            for i in range(args.count):
                print(f"host {i}: {hosts.addr(i)}  run there with: {' '.join(hosts.exec_prefix(i))} COMMAND")
            print(f"links: {args.rate or 'uncapped'}; remove with: python -m ringtrain.testing.hosts down")
        elif args.command == "down":
            made = [n for n in hosts.made if n in namespaces()]
            hosts.down()
            stale = sweep_stale()
            print(f"removed {len(made) + len(stale)} namespaces")
        elif args.command == "cut":
            hosts.cut(args.host)
        else:
            hosts.restore(args.host)
    except HostsError as err:
        print(f"ringtrain.testing.hosts: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
