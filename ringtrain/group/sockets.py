"""The default process group's own TCP sockets, so a failed group can be closed under a peer that waits on it.

Gloo gives no way to abort a group: ``destroy_process_group()`` on a group with a collective still in flight
waits for it until the group's timeout (``dist.timeout_s``), and until then its sockets stay open, so a live
peer blocked in a collective on this rank waits the full timeout too. Shutting the group's sockets down
(``SHUT_RDWR``) first makes the peer's collective fail at once and the local one return, so the destroy is
immediate. Only the group's own sockets may be touched (a user's script may hold its own), so they are picked
out when the group is made:

- ``recording_group_sockets(store)`` wraps ``dist.init_process_group``: the sockets that appear in
  /proc/self/fd across it, TCP connections, with neither end on a port of ``store`` (rank 0's TCPStore server
  accepts the other ranks' store clients during the init; those belong to the store, not to the group). The
  store itself (the job store client, or the rendezvous store) is made before, outside the window. (A
  socket that another thread opened during the init would be taken for the group's: ringtrain's threads
  open theirs, the heartbeat's job store client, outside it, and to the store's port, which is left out.)
- Gloo connects every pair inside the init unless ``TORCH_GLOO_LAZY_INIT`` is set (then a pair connects on
  its first collective, after the window, where it could not be told from a user's socket): the variable is
  lifted for the duration of the init, so every pair of the group is connected, and recorded, inside it.
- ``shutdown_group_sockets()`` shuts each recorded socket down, keeping its descriptor (Gloo still owns and
  closes it); a descriptor that no longer names the same socket (closed, or closed and reused) is left alone.
  Gloo may close one while this runs, so each is pinned with ``dup`` before it is checked and shut down.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch.distributed as dist

__all__ = ["recording_group_sockets", "new_recorded_group", "shutdown_group_sockets", "forget_group_sockets",
           "group_sockets"]

_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
_recorded: list[tuple[int, str]] = []
"""(descriptor, the socket it named: 'socket:[inode]') for each TCP connection of the current default group."""


def group_sockets() -> list[tuple[int, str]]:
    """The recorded sockets of the current default group: (descriptor, 'socket:[inode]')."""
    return list(_recorded)


@contextmanager
def recording_group_sockets(store: dist.Store | None, append: bool = False) -> Iterator[None]:
    """Record the TCP sockets the default group's init opens (wrap ``dist.init_process_group`` in it);
    ``append``: a group made beside the default one (``new_recorded_group``), recorded with it."""
    before = _socket_fds()
    lazy = os.environ.pop(_LAZY_INIT, None)
    try:
        yield
    finally:
        if lazy is not None:
            os.environ[_LAZY_INIT] = lazy
    new = {fd: name for fd, name in _socket_fds().items() if before.get(fd) != name}
    store_ports = _store_ports(store)
    found = [
        (c.fd, new[c.fd]) for c in psutil.Process().net_connections(kind="tcp")
        if c.fd in new and c.raddr and c.laddr.port not in store_ports and c.raddr.port not in store_ports
    ]
    _recorded[:] = [*_recorded, *found] if append else found


def new_recorded_group(**kwargs):
    """``dist.new_group(**kwargs)`` whose sockets are recorded with the default group's, so that
    ``shutdown_group_sockets`` wakes a peer blocked in one of its collectives too (a sharded checkpoint's)."""
    store = dist.distributed_c10d._get_default_store()
    with recording_group_sockets(store, append=True):
        return dist.new_group(**kwargs)


def shutdown_group_sockets() -> int:
    """Shut the recorded sockets down (both directions), keeping their descriptors; returns how many.

    Gloo's own threads may close a descriptor at any moment (a pair that failed), so each is first
    duplicated, which pins whatever socket it names at that instant or fails if it is closed; the duplicate is
    checked to be the recorded socket (not a reuse of the number for another) and shut down, then closed.
    There is no window between the check and the shutdown for the descriptor to change under it."""
    done = 0
    for fd, name in _recorded:
        try:
            pinned = os.dup(fd)
        except OSError:
            continue  # closed since: nothing of the group's left on it
        try:
            if f"socket:[{os.fstat(pinned).st_ino}]" != name:
                continue  # closed and reused for another socket: not the group's any more
            sock = socket.socket(fileno=pinned)
            try:
                sock.shutdown(socket.SHUT_RDWR)  # acts on the socket, so on Gloo's descriptor of it too
                done += 1
            except OSError:
                pass  # already shut down or reset by the peer
            finally:
                sock.detach()
        finally:
            os.close(pinned)
    _recorded.clear()
    return done


def forget_group_sockets() -> None:
    """The group is destroyed in the ordinary way (its sockets closed by Gloo): nothing is kept."""
    _recorded.clear()


def _socket_fds() -> dict[int, str]:
    """This process's open socket descriptors and the socket each names."""
    fds: dict[int, str] = {}
    if not os.path.isdir("/proc/self/fd"):
        return fds  # not Linux: nothing recorded, a failed group is destroyed after its timeout as before
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue  # closed while listing (the scandir's own descriptor, another thread's)
        if target.startswith("socket:"):
            fds[int(entry.name)] = target
    return fds


def _store_ports(store: dist.Store | None) -> set[int]:
    """The TCP ports of ``store`` and of the stores it wraps."""
    ports = set()
    while store is not None:
        if isinstance(store, dist.TCPStore):
            ports.add(store.port)
        store = getattr(store, "underlying_store", None)
    return ports
