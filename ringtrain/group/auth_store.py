"""A store whose every value is sealed with the job's secret (group/auth.py): what the job did not write is
never read.

    store = AuthStore(dist.TCPStore(host, port, is_master=False), secret, where=f"the job store at {host}:{port}")
    dist.PrefixStore("ringtrain/run/", store).set("key", "value")   # sealed under the full key
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ringtrain.group.auth import JobSecret

__all__ = ["AuthStore"]

_LIVE: list[AuthStore] = []
"""Every AuthStore this process made, kept alive (see AuthStore)."""


class AuthStore(dist.Store):
    """A store whose values are sealed with the job's secret: ``set`` seals, ``get`` opens (or raises
    UnsealedValue). Wrap the connection itself (the TCPStore client), below any PrefixStore, so that every
    process seals a key under the same full name. torch's own code (Gloo's rendezvous, the elastic agent's
    PrefixStores) uses it as any store. It lives as long as the process: its methods are Python's, and a
    PrefixStore built over it keeps only its C++ half alive (a freed one answers "pure virtual function" or "Not
    implemented"); a process makes a handful (the job store, the workers' store, one per watching thread)."""

    def __init__(self, store: dist.Store, secret: JobSecret, where: str):
        super().__init__()
        self._store, self._secret, self._where = store, secret, where
        _LIVE.append(self)

    @property
    def underlying_store(self) -> dist.Store:
        return self._store

    @property
    def where(self) -> str:
        return self._where

    def _seal(self, key: str, value) -> bytes:
        return self._secret.seal(key, _as_bytes(value))

    def _open(self, key: str, sealed: bytes) -> bytes:
        return self._secret.open(key, bytes(sealed), self._where)

    def set(self, key: str, value) -> None:
        self._store.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self._store.get(key))

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = _as_bytes(expected)
        # A seal is deterministic: the expected value sealed is exactly what the job stored, if it did.
        current = self._store.compare_set(key, self._seal(key, expected) if expected else b"", self._seal(key, desired))
        return self._open(key, current)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
