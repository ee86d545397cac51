"""torch's c10d rendezvous, sealed with the job's secret: the rendezvous backend ringtrain's launcher uses.

torch's ``DynamicRendezvousHandler`` keeps the rendezvous state as a pickle in the store and unpickles what it
reads (a stranger's pickle would run in the agent). Here the handler is torch's own, built the way torch builds
its ``c10d`` one, with two changes made through the elastic agent's extension point (the rendezvous handler
registry): the store under it is an ``AuthStore`` (every value sealed with the job's secret, so only state the
job wrote is unpickled), and the backend writes its last good state over one it cannot open, so a job whose
state was tampered with goes on. torchrun keeps torch's ``c10d`` backend as it is.

    LaunchConfig(..., rdzv_backend=BACKEND)      # after register()
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, _create_tcp_store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ringtrain.group.auth import JobSecret, UnsealedValue, load_job_secret
from ringtrain.group.auth_store import AuthStore

__all__ = ["BACKEND", "register", "SealedRendezvousBackend"]

BACKEND = "ringtrain-c10d"
"""The name the launcher asks torch's launcher for (bench/rendezvous_cost.py sets it to torch's "c10d" to compare)."""
_SEALED = BACKEND


class SealedRendezvousBackend(C10dRendezvousBackend):
    """torch's c10d backend over an AuthStore. A state it cannot open (a stranger's write) is refused in one
    line, and this agent's last good state is written over it, so the rendezvous goes on from there."""

    def __init__(self, store: AuthStore, run_id: str):
        self._last_good: bytes | None = None
        self._warned = False
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        return _SEALED

    def _call_store(self, store_op: str, *args, **kwargs):
        try:
            value = super()._call_store(store_op, *args, **kwargs)
        except RendezvousConnectionError as err:
            if not isinstance(err.__cause__, UnsealedValue):
                raise
            if not self._warned:
                self._warned = True
                print(f"ringtrain: warning: {err.__cause__}; the rendezvous goes on from this agent's last good state",
                      file=sys.stderr, flush=True)
            good = self._last_good if self._last_good is not None else self._NULL_SENTINEL.encode()
            super()._call_store("set", self._key, good)
            value = good
        if store_op in ("get", "compare_set"):
            self._last_good = bytes(value)
        return value


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    secret = load_job_secret(os.environ)
    if secret is None:  # the launcher always sets one (launch.py); never a rendezvous without it
        raise RendezvousConnectionError("ringtrain's rendezvous needs the job's secret (RINGTRAIN_JOB_SECRET)")
    store = _sealed_client(params, secret)
    return create_handler(store, SealedRendezvousBackend(store, params.run_id), params)


def _sealed_client(params: RendezvousParameters, secret: JobSecret) -> AuthStore:
    return AuthStore(_create_tcp_store(params), secret, where=f"the rendezvous store at {params.endpoint}")


def register() -> None:
    """Make BACKEND a rendezvous backend name torch's launcher resolves (idempotent)."""
    rendezvous_handler_registry.register(_SEALED, _create_handler)
