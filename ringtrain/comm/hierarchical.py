"""Hierarchical all-reduce for groups that span hosts: shared memory inside a host, a ring between hosts.

1. the ranks of each host sum their tensors through shared memory (``shm.local_all_reduce``);
2. the first rank of each host (its leader) all-reduces the host sums with the other leaders over a ring
   (point-to-point inside the same process group: no extra group to create);
3. each leader copies the result to the ranks of its host through shared memory.

Large tensors go through in pieces of ``PIPELINE_PIECE_BYTES``, pipelined: while the leaders ring piece k
(on one thread of the leader's, kept per group), the host's ranks already sum piece k+1 through shared
memory, and the copy of piece k to the host's ranks starts as soon as its ring is done. Every rank of a
host makes the same calls in the same order (all pieces' sums, then all pieces' copies), and only the
leader's ring thread touches the process group during the call.

Only leaders touch the network, once per host instead of once per rank. Every step is bit-identical
across its participants (shm sums, the ring, a copy), so every rank ends with the same bits. One machine
can exercise it by declaring its ranks to be on two hosts: ``shm.init_shm(hosts=["a", "a", "b", "b"])``::

    >>> hierarchical.all_reduce(shm_group, flat, timeout_s=60.0, average=True)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ringtrain.comm import ring
from ringtrain.comm.shm import broadcast_from_leader, local_all_reduce
from ringtrain.comm.shm_group import ShmGroup

__all__ = ["all_reduce", "PIPELINE_PIECE_BYTES"]

PIPELINE_PIECE_BYTES = 8 << 20
"""Pieces of a pipelined hierarchical all-reduce; tensors under two pieces go through in one."""


def all_reduce(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Sum (or average over the whole group) ``flat`` in place across every host of ``sg``."""
    piece = max(1, PIPELINE_PIECE_BYTES // flat.element_size())
    pieces = [flat[lo : lo + piece] for lo in range(0, flat.numel(), piece)]
    if len(pieces) < 2:
        pieces = [flat]
    # Every leader rings the same pieces; one alone on its host has nothing to overlap, and rings them here.
    overlap = len(pieces) > 1 and sg.local_size > 1
    rings = []
    for part in pieces:
        # Averaging divides by the size of the whole group, on the way into the first sum.
        local_all_reduce(sg, part, timeout_s, average, divide_by=sg.size)
        if sg.is_leader and overlap:
            rings.append(_ring_thread(sg).submit(_leaders_ring, sg, part, timeout_s))
        elif sg.is_leader:
            _leaders_ring(sg, part, timeout_s)
    for index, part in enumerate(pieces):
        if rings:
            rings[index].result()  # re-raises the ring's CollectiveError here
        if sg.local_size > 1:
            broadcast_from_leader(sg, part, timeout_s)
    return flat


def _leaders_ring(sg: ShmGroup, part: torch.Tensor, timeout_s: float) -> torch.Tensor:
    return ring.all_reduce(part, sg.group, timeout_s, members=sg.leaders, what="shm all_reduce (ring between hosts)")


def _ring_thread(sg: ShmGroup) -> ThreadPoolExecutor:
    """The leader's one thread for the leaders' ring (its receive buffers are kept per thread)."""
    executor = getattr(sg, "_ring_executor", None)
    if executor is None:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtrain-hier-ring")
        sg._ring_executor = executor
    return executor
