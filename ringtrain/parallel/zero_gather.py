"""zero3's parameters gathered around their use: a unit's flat buffer is allocated and all-gathered just
before its forward and its backward and freed after (FSDP's trick: the parameters keep their shapes, their
storage is resized to zero bytes), and with prefetch the next unit's all-gather runs on the communication
thread (``CommQueue``) while the current unit computes.

Prefetch order: in forward, the block after this one (the model's block order); in backward, the block that
ran before this one in the forward (the order recorded then). At most ``max_gathered`` blocks (2) hold
gathered storage at once, counting the one being prefetched: a prefetch that would exceed it waits until a
block is freed, so zero3 holds the root unit, two blocks and one block's gradient staging at most.

    gatherer = Gatherer(start_gather, queue, hold, blocks)
    gatherer.before_forward(unit, next_unit)   # gathered (waited); next_unit's gather started
    gatherer.free(unit)                        # after its forward; a waiting prefetch may start now
    gatherer.before_backward(unit)             # gathered; the previous block's gather started
    gatherer.end_pass()                        # drain the queue, free prefetches nobody used
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from ringtrain.parallel.comm_queue import CommQueue
from ringtrain.parallel.zero_flat import FlatUnit

__all__ = ["Gatherer"]


class Gatherer:
    """Which zero3 units hold gathered parameters, and the gathers in flight."""

    def __init__(self, start: Callable[[FlatUnit], Future | None], queue: CommQueue | None,
                 hold: Callable[[int], None], blocks: list[FlatUnit], max_gathered: int = 2):
        self._start = start
        """Fills ``unit.full`` from every rank's shard (a collective): on ``queue``'s thread (returns its future),
        or now (returns None) when there is no queue."""
        self.queue = queue
        """None: no prefetch, every gather runs on the caller's thread."""
        self._hold = hold
        self._blocks = {id(u) for u in blocks}
        self.max_gathered = max_gathered
        self._in_flight: dict[int, Future] = {}
        self._gathered: dict[int, FlatUnit] = {}
        self._wanted: FlatUnit | None = None
        self._ran: list[FlatUnit] = []
        """Blocks in the order their forward ran with gradients (the backward runs them in reverse)."""
        self.prefetched = 0
        """Gathers started ahead of their use so far."""
        self.in_backward = False
        """A backward began since the last forward: a block's forward now is activation checkpointing's
        recompute, which needs the block's parameters and must neither free them nor prefetch."""

    # --- the passes -------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        self._ran = []
        self.in_backward = False

    def before_forward(self, unit: FlatUnit, following: FlatUnit | None, grad_enabled: bool) -> None:
        self.gather(unit)
        if grad_enabled:
            self._ran.append(unit)
        if following is not None:
            self.prefetch(following)

    def before_backward(self, unit: FlatUnit) -> None:
        self.in_backward = True
        self.gather(unit)
        index = next((i for i, u in enumerate(self._ran) if u is unit), 0)
        if index > 0:
            self.prefetch(self._ran[index - 1])

    def end_pass(self) -> None:
        """Nothing in flight, and no block gathered (a prefetched block whose pass never came is freed)."""
        if self.queue is not None:
            self.queue.drain()
        self._in_flight.clear()
        self._wanted = None
        for unit in list(self._gathered.values()):
            if id(unit) in self._blocks:
                self.free(unit)

    # --- one unit ---------------------------------------------------------------------------------------
    def gather(self, unit: FlatUnit) -> None:
        """``unit``'s parameters, complete, now."""
        if id(unit) not in self._gathered:
            self._launch(unit)
        future = self._in_flight.pop(id(unit), None)
        if future is not None:
            self.queue.wait(future)

    def prefetch(self, unit: FlatUnit) -> None:
        """Start ``unit``'s gather on the communication thread, now or once a block is freed."""
        if self.queue is None or id(unit) in self._gathered:
            return
        if sum(1 for i in self._gathered if i in self._blocks) >= self.max_gathered:
            self._wanted = unit
            return
        self._wanted = None
        self._launch(unit)
        self.prefetched += 1

    def free(self, unit: FlatUnit) -> None:
        if self._gathered.pop(id(unit), None) is None:
            return
        future = self._in_flight.pop(id(unit), None)
        if future is not None:  # never used: let its gather finish before the storage goes
            self.queue.wait(future)
        unit.full.untyped_storage().resize_(0)
        self._hold(-unit.nbytes)
        if self._wanted is not None:
            self.prefetch(self._wanted)

    def _launch(self, unit: FlatUnit) -> None:
        unit.full.untyped_storage().resize_(unit.nbytes)
        self._hold(unit.nbytes)
        self._gathered[id(unit)] = unit
        with torch.no_grad():
            unit.full[unit.lo : unit.hi].copy_(unit.shard)
        future = self._start(unit)
        if future is not None:
            self._in_flight[id(unit)] = future
