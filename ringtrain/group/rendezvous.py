"""torch's c10d rendezvous, sealed with the job's secret: the rendezvous backend ringtrain's launcher uses.

torch's ``DynamicRendezvousHandler`` keeps the rendezvous state as a pickle in the store and unpickles what it
reads (a stranger's pickle would run in the agent). Here the handler is torch's own, built the way torch builds
its ``c10d`` one, with two changes made through the elastic agent's extension point (the rendezvous handler
registry): the store under it is an ``AuthStore`` (every value sealed with the job's secret, so only state the
job wrote is unpickled), and the backend writes its last good state over one it cannot open, so a job whose
state was tampered with goes on. torchrun keeps torch's ``c10d`` backend as it is.

Node order: torch numbers the nodes of a round by sorting their descriptors (address, pid, id), so node i of
the job got whichever group rank its ``--local-addr`` sorted to, not ``--node-rank i``: a hostfile of
``localhost`` then ``127.0.0.1`` (or ``node9`` then ``node10``) put global rank 0 on its second host, whose name
then prefixed rank 0's lines. Here each agent's descriptor is a ``RankedNode`` that sorts by the launcher's
``--node-rank`` first (the ``node_rank`` rendezvous option, launch.py), then as torch does: node i holds ranks
``i * nproc ...``, rank 0 on node 0, the rendezvous host. Agents of one ``--node-rank`` (every agent of a
one-node job, the joiners of an elastic one) keep torch's order among themselves.

    LaunchConfig(..., rdzv_backend=BACKEND)      # after register()
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, _create_tcp_store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, create_handler

from ringtrain.group.auth import JobSecret, UnsealedValue, load_job_secret
from ringtrain.group.auth_store import AuthStore

__all__ = ["BACKEND", "register", "stop_heartbeats", "SealedRendezvousBackend", "RankedNode", "NODE_RANK_OPTION"]

BACKEND = "ringtrain-c10d"
"""The name the launcher asks torch's launcher for (bench/rendezvous_cost.py sets it to torch's "c10d" to compare)."""
_SEALED = BACKEND
NODE_RANK_OPTION = "node_rank"
"""The rendezvous option (LaunchConfig.rdzv_configs) that carries the launcher's --node-rank to the handler."""


@dataclass(eq=True, order=False, frozen=True)
class RankedNode(_NodeDesc):
    """torch's node descriptor that sorts by the launcher's ``--node-rank`` first (torch ranks a round's nodes
    in sorted order): the rest of torch sees the same address, pid and id."""

    node_rank: int = 0

    def _order(self) -> tuple:
        return (getattr(self, "node_rank", 0), self.addr, self.pid, self.local_id)

    def __lt__(self, other: _NodeDesc) -> bool:
        return self._order() < RankedNode._order(other)

    def __le__(self, other: _NodeDesc) -> bool:
        return self._order() <= RankedNode._order(other)

    def __gt__(self, other: _NodeDesc) -> bool:
        return self._order() > RankedNode._order(other)

    def __ge__(self, other: _NodeDesc) -> bool:
        return self._order() >= RankedNode._order(other)

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}_node{self.node_rank}"


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
    handler = create_handler(store, SealedRendezvousBackend(store, params.run_id), params)
    node_rank = params.get_as_int(NODE_RANK_OPTION, 0) or 0
    node, executor = getattr(handler, "_this_node", None), getattr(handler, "_op_executor", None)
    if isinstance(node, _NodeDesc) and hasattr(executor, "_node"):
        # The handler's descriptor, as torch made it, with the node rank beside it (both places torch keeps it).
        handler._this_node = executor._node = RankedNode(node.addr, node.pid, node.local_id, node_rank)
    _HANDLERS.add(handler)
    return handler


_HANDLERS: "weakref.WeakSet[RendezvousHandler]" = weakref.WeakSet()


def stop_heartbeats() -> None:
    """Stop the keep-alive thread of every handler this process made, without joining it.

    torch's launcher leaves a handler's heartbeats running when the agent stops on a signal (it does not shut
    the rendezvous down, so that other nodes may go on). The timer's thread then holds the handler while it
    beats; if the last reference to the handler goes while it does, the timer's finalizer runs on that thread
    and joins it: ``RuntimeError: cannot join current thread``, printed as a traceback after ringtrain's
    "stopped" line. Here the finalizer is detached and the thread told to stop (it ends at its next wake-up:
    a beat in flight against a store that is gone must not hold the launcher's exit). Closing the rendezvous
    stays torch's choice."""
    for handler in list(_HANDLERS):
        timer = getattr(handler, "_keep_alive_timer", None)
        finalizer = getattr(timer, "_finalizer", None)
        if finalizer is not None and finalizer.detach() is not None:
            timer._ctx.stop_event.set()


def _sealed_client(params: RendezvousParameters, secret: JobSecret) -> AuthStore:
    return AuthStore(_create_tcp_store(params), secret, where=f"the rendezvous store at {params.endpoint}")


def register() -> None:
    """Make BACKEND a rendezvous backend name torch's launcher resolves (idempotent)."""
    rendezvous_handler_registry.register(_SEALED, _create_handler)
