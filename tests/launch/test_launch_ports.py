"""The worker group's store port (ringtrain/launch.py): picked below the kernel's ephemeral range, where no
outgoing connection can take it between torch's agent picking it and rank 0 binding it, and free when picked."""

from __future__ import annotations

import random
import socket

import pytest
import torch.distributed.elastic.rendezvous.api as rendezvous_api

from ringtrain import launch

pytestmark = pytest.mark.unit


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        return int(ports.read().split()[0])


def test_the_agent_picks_listener_ports_below_the_ephemeral_range_and_free(monkeypatch):
    monkeypatch.setattr(rendezvous_api, "get_free_port", rendezvous_api.get_free_port)  # restored after the test
    launch._pick_worker_store_ports_outside_the_ephemeral_range()
    low = _ephemeral_low()
    ports = {rendezvous_api.get_free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    # Held by a listener, a port is not picked: each candidate is checked by binding it.
    with socket.socket() as held:
        held.bind(("", next(iter(ports))))
        held.listen()
        taken = held.getsockname()[1]
        free = next(p for p in range(low - 1, 1024, -1) if p != taken and _bindable(p))
        monkeypatch.setattr(random, "sample", lambda population, k: [taken, free])
        assert launch._listener_port() == free


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
        return True
