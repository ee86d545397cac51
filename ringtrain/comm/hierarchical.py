"""Hierarchical all-reduce for groups that span hosts: shared memory inside a host, a ring between hosts.

1. the ranks of each host sum their tensors through shared memory (``shm.local_all_reduce``);
2. the first rank of each host (its leader) all-reduces the host sums with the other leaders over a ring
   (point-to-point inside the same process group: no extra group to create);
3. each leader copies the result to the ranks of its host through shared memory.

Only leaders touch the network, once per host instead of once per rank. Every step is bit-identical
across its participants (shm sums, the ring, a copy), so every rank ends with the same bits. One machine
can exercise it by declaring its ranks to be on two hosts: ``shm.init_shm(hosts=["a", "a", "b", "b"])``::

    >>> hierarchical.all_reduce(shm_group, flat, timeout_s=60.0, average=True)
"""

from __future__ import annotations

import torch

from ringtrain.comm import ring
from ringtrain.comm.shm import broadcast_from_leader, local_all_reduce
from ringtrain.comm.shm_group import ShmGroup

__all__ = ["all_reduce"]


def all_reduce(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Sum (or average over the whole group) ``flat`` in place across every host of ``sg``."""
    # Averaging divides by the size of the whole group, on the way into the first sum.
    local_all_reduce(sg, flat, timeout_s, average, divide_by=sg.size)
    if sg.is_leader:
        ring.all_reduce(flat, sg.group, timeout_s, members=sg.leaders, what="shm all_reduce (ring between hosts)")
    if sg.local_size > 1:
        broadcast_from_leader(sg, flat, timeout_s)
    return flat
