"""Fixtures for tests across test hosts (network namespaces, ``tests/hosts.py``); they skip without root."""

from __future__ import annotations

import pytest

from tests.hosts import Hosts, unavailable


@pytest.fixture
def make_hosts():
    """``make_hosts(count, rate=None)`` -> Hosts, removed after the test (also when it fails)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(count: int, rate: str | None = None) -> Hosts:
        hosts = Hosts.up(count, rate)
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.down()
