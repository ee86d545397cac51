"""Addresses between hosts, checked before anything waits on them: a wrong one is one line, not a hang.

torch's agent would wait up to its join timeout (600 s) on a rendezvous endpoint that nobody answers at, and
then print a C++ stack trace; a ``--local-addr`` that is not this host's hangs the workers' Gloo set-up.
``check_local_addr`` and ``reach_rendezvous`` run in the launcher first::

    >>> check_local_addr("198.18.0.2")                    # 'veth0', or LaunchError naming the addresses it has
    >>> reach_rendezvous("198.18.0.1", 29400, None, 60)   # '198.18.0.2': where the others reach this host
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time

from ringtrain.group.init import interface_for_address
from ringtrain.errors import LaunchError

__all__ = ["bind_address", "check_local_addr", "reach_rendezvous", "RENDEZVOUS_WAIT_S"]

RENDEZVOUS_WAIT_S = 45
"""How long a node waits for the rendezvous endpoint to accept a connection (node 0 may start later);
``--rdzv-conf read_timeout=N`` (torch's key for the same store connection) changes it. 45 s: with the start-up,
the error comes within a minute."""

# Answers that will not change by waiting: no route from here, or an address that cannot be used from here.
_FATAL = {errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.EINVAL, errno.EAFNOSUPPORT}


def check_local_addr(address: str) -> str:
    """The interface holding ``address``; LaunchError (naming this host's addresses) if none does."""
    try:
        return interface_for_address(address)
    except OSError:  # not an address, nor a name that resolves
        raise LaunchError(f"--local-addr {address!r} is not an address of this host; pass one of its addresses") from None


def reach_rendezvous(host: str, port: int, local_addr: str | None, timeout_s: float) -> str:
    """Connect to the rendezvous at ``host:port`` (from ``local_addr``, if given) until it accepts, and return
    the local address the connection left from: the address on the network the other hosts share.

    A refused or unanswered connection is retried (node 0's launcher may not be up yet) for ``timeout_s``;
    an unroutable one fails at once. Either way the error names both addresses and the flag to fix.
    """
    deadline = time.monotonic() + timeout_s
    source = f"from {local_addr}" if local_addr else "from this host"
    while True:
        try:
            return _connect(host, port, local_addr, max(0.2, min(5.0, deadline - time.monotonic())))
        except OSError as err:
            reason = err.strerror or str(err) or type(err).__name__
            if err.errno in _FATAL or _loopback_cannot_reach(local_addr, host):
                raise LaunchError(
                    f"cannot reach the rendezvous {host}:{port} {source} ({reason}): --rdzv-endpoint must be node 0's "
                    "address on a network this host shares, and --local-addr this host's address on it"
                ) from None
            if time.monotonic() >= deadline:
                refused = err.errno == errno.ECONNREFUSED
                hint = ("is node 0's launcher running with this --rdzv-endpoint?" if refused
                        else "is --rdzv-endpoint node 0's address, and is its link up?")
                raise LaunchError(
                    f"the rendezvous {host}:{port} did not answer within {timeout_s:g} s {source} ({reason}): {hint}"
                ) from None
        time.sleep(0.5)


def _connect(host: str, port: int, local_addr: str | None, timeout_s: float) -> str:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        if local_addr:
            sock.bind((local_addr, 0))
        sock.connect((host, port))
        return sock.getsockname()[0]


def _loopback_cannot_reach(local_addr: str | None, host: str) -> bool:
    """A loopback source and a host on another machine (or the reverse) never meet, however long one waits.
    One of this machine's own addresses is reachable from loopback: that is a refusal worth waiting out (node
    0's launcher on this machine may not be listening yet)."""
    if not local_addr or _is_loopback(local_addr) == _is_loopback(host):
        return False
    return not (_on_this_host(host) and _on_this_host(local_addr))


def _on_this_host(address: str) -> bool:
    try:
        interface_for_address(address)
        return True
    except (OSError, LaunchError):
        return False


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def bind_address(local_addr: str | None, host: str, port: int, hosts_store: bool, wait_s: float) -> str:
    """The address this node's workers bind to, checked before any worker starts: ``--local-addr``; else, on
    the node that hosts the rendezvous, the endpoint's host; else the address this node reaches the
    rendezvous from. A node that does not host it also waits (``wait_s``) for the rendezvous to answer."""
    if local_addr:
        check_local_addr(local_addr)
    if hosts_store:
        return local_addr or host
    reached_from = reach_rendezvous(host, port, local_addr, wait_s)
    return local_addr or reached_from
