"""group/sockets.py on real loopback TCP connections: the sockets opened inside ``recording_group_sockets`` are the
ones ``shutdown_group_sockets`` shuts down; a descriptor closed since, or closed and reused for another socket,
is left alone; and a descriptor closed by another thread while the shutdown runs (as Gloo's threads close a
failed pair's) never makes it raise (it did: ``OSError: [Errno 9] Bad file descriptor`` ended a healing worker).
"""

from __future__ import annotations

import socket
import threading

import pytest

from ringtrain.group import sockets
from ringtrain.group.sockets import group_sockets, recording_group_sockets, shutdown_group_sockets

pytestmark = pytest.mark.unit


def connected_pairs(count: int) -> tuple[socket.socket, list[tuple[socket.socket, socket.socket]]]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=count)
    pairs = []
    for _ in range(count):
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        pairs.append((client, server))
    return listener, pairs


def is_shut_down(sock: socket.socket) -> bool:
    sock.settimeout(1.0)
    return sock.recv(1) == b""  # a live, idle connection would time out instead


def test_only_the_recorded_sockets_still_named_by_their_descriptors_are_shut_down():
    outside, (before,) = connected_pairs(1)  # a user's connection, made before the window
    with recording_group_sockets(None):
        listener, [(client, server)] = connected_pairs(1)
    recorded = dict(group_sockets())
    assert set(recorded) == {client.fileno(), server.fileno()}  # not the listener, not the user's pair
    reused_fd = client.fileno()
    client.close()
    reuser, reuser_peer = socket.socketpair()
    assert reuser.fileno() == reused_fd  # the lowest free number: it now names another socket

    assert shutdown_group_sockets() == 1  # the server end only
    assert is_shut_down(server)
    reuser.sendall(b"x")
    assert reuser_peer.recv(1) == b"x"  # the socket that took the closed one's number still works
    before[0].sendall(b"y")
    assert before[1].recv(1) == b"y"
    assert group_sockets() == []
    for sock in (outside, *before, listener, server, reuser, reuser_peer):
        sock.close()


def test_descriptors_closed_by_another_thread_during_the_shutdown_never_make_it_raise():
    for _ in range(20):
        with recording_group_sockets(None):
            listener, pairs = connected_pairs(40)
        assert len(group_sockets()) == 80
        ends = [end for pair in pairs for end in pair]
        closer = threading.Thread(target=lambda: [end.close() for end in ends[::-1]])
        closer.start()
        done = shutdown_group_sockets()  # raised EBADF when a close fell between its check and its use
        closer.join()
        assert 0 <= done <= 80
        assert sockets.group_sockets() == []
        listener.close()
