"""Hierarchical all-reduce for groups that span hosts: shared memory inside a host, the wire between hosts.

1. the ranks of each host sum their tensors through shared memory (``shm.local_all_reduce``);
2. the first rank of each host (its leader) all-reduces the host sums with the other leaders
   (point-to-point inside the same process group: no extra group to create);
3. each leader copies the result to the ranks of its host through shared memory.

Only leaders touch the network, once per host instead of once per rank, and the host's work hides behind
the wire rather than coming before and after it:

- **Two hosts** (``_two_hosts``): each leader owns one half of the tensor. It sums the other half inside
  its host piece by piece (``ring.MAX_MESSAGE_BYTES``), sending each piece as soon as it is summed; sums
  its own half; then, as each piece of the peer's partial sums arrives, adds it, sends the finished piece
  back at once and copies it to its host, and copies out the peer's finished pieces as they arrive. Each
  direction of the link carries half the tensor twice, like a ring reduce-scatter + all-gather, but as one
  stream: no barrier between the two phases, and only one piece's sum comes before the wire and one piece's
  copy after it. Measured across two test hosts x 2 at 64 MB over 1 Gbit/s: docs/benchmarks.md.
- **More hosts**: a ring between the leaders (``ring.py``); the host sums each ring shard while the
  previous step is on the wire, and copies each finished shard out while the next one travels.

Every step is bit-identical across its participants (shm sums, one owner adding two host sums, copies), so
every rank ends with the same bits. The non-leaders make the same shared-memory calls in the same order as
their leader. One machine can exercise it by declaring its ranks to be on two hosts:
``shm.init_shm(hosts=["a", "a", "b", "b"])``::

    >>> hierarchical.all_reduce(shm_group, flat, timeout_s=60.0, average=True)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain.comm import ring
from ringtrain.comm.scratch import scratch
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.shm_local import broadcast_from_leader, local_all_reduce
from ringtrain.comm.shm_group import ShmGroup

__all__ = ["all_reduce"]

_WHAT = "shm all_reduce (between hosts)"


def all_reduce(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Sum (or average over the whole group) the 1-D ``flat`` in place across every host of ``sg``."""
    if len(sg.leaders) == 2:
        return _two_hosts(sg, flat, timeout_s, average)
    return _ring(sg, flat, timeout_s, average)


def _host_sum(sg: ShmGroup, part: torch.Tensor, timeout_s: float, average: bool) -> None:
    """Sum ``part`` over this host; averaging divides by the size of the whole group on the way in."""
    if part.numel():  # every local rank skips the same empty parts
        local_all_reduce(sg, part, timeout_s, average, divide_by=sg.size)


def _copy_out(sg: ShmGroup, part: torch.Tensor, timeout_s: float) -> None:
    """The leader's ``part`` to every rank of this host."""
    if sg.local_size > 1 and part.numel():
        broadcast_from_leader(sg, part, timeout_s)


def _pieces(bounds: tuple[int, int], step: int) -> list[tuple[int, int]]:
    lo, hi = bounds
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


def _two_hosts(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool) -> torch.Tensor:
    position = sg.leaders.index(sg.local[0])  # 0 or 1: this host owns half ``position``
    halves = tensor_shards(flat, 2)
    step = max(1, ring.MAX_MESSAGE_BYTES // flat.element_size())
    mine, theirs = _pieces(halves[position], step), _pieces(halves[1 - position], step)
    if not sg.is_leader:
        for lo, hi in theirs + mine:
            _host_sum(sg, flat[lo:hi], timeout_s, average)
        for lo, hi in mine + theirs:
            _copy_out(sg, flat[lo:hi], timeout_s)
        return flat
    # Tags: the partial sums of piece k travel with tag 1 + k, the finished piece k with 1 + K + k (K: pieces of
    # the larger half, the same number on both leaders); a collective waits for all its messages, so tags
    # can repeat from call to call.
    first = 1 + len(_pieces(halves[0], step))
    peers = ring.RingPeers(sg.group, timeout_s, _WHAT, members=sg.leaders)
    peer, steps = peers.right, len(mine) + len(theirs)
    base = halves[position][0]
    incoming = scratch(halves[position][1] - base, flat.dtype, flat.device)

    def receive(tensor: torch.Tensor, tag: int) -> dist.Work:
        return dist.irecv(tensor, group=sg.group, tag=tag, group_src=peer)

    def send(tensor: torch.Tensor, tag: int) -> dist.Work:
        return dist.isend(tensor, group=sg.group, tag=tag, group_dst=peer)

    # Receives first (see RingPeers.post): both directions share one Gloo pair.
    partial = [receive(incoming[lo - base : hi - base], 1 + k) for k, (lo, hi) in enumerate(mine)]
    finished = [receive(flat[lo:hi], first + k) for k, (lo, hi) in enumerate(theirs)]
    # A finished piece of the peer's half overwrites what this leader sent of it: the peer finishes that
    # piece only after receiving all of it, so the send has read it by then.
    sends = []
    for k, (lo, hi) in enumerate(theirs):
        _host_sum(sg, flat[lo:hi], timeout_s, average)
        sends.append(send(flat[lo:hi], 1 + k))
    for lo, hi in mine:
        _host_sum(sg, flat[lo:hi], timeout_s, average)
    for k, (lo, hi) in enumerate(mine):
        peers.wait(partial[k], peer, k + 1, steps, receiving=True)
        flat[lo:hi].add_(incoming[lo - base : hi - base])
        sends.append(send(flat[lo:hi], first + k))
        _copy_out(sg, flat[lo:hi], timeout_s)
    for k, (lo, hi) in enumerate(theirs):
        peers.wait(finished[k], peer, len(mine) + k + 1, steps, receiving=True)
        _copy_out(sg, flat[lo:hi], timeout_s)
    for k, work in enumerate(sends):
        peers.wait(work, peer, k + 1, steps, receiving=False)
    return flat


def _ring(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool) -> torch.Tensor:
    hosts = len(sg.leaders)
    position = sg.leaders.index(sg.local[0])  # this host's leader's place in the ring
    bounds = tensor_shards(flat, hosts)
    sums = [flat[slice(*bounds[j])] for j in ring.reduce_scatter_order(position, hosts)]
    finals = [flat[slice(*bounds[j])] for j in ring.all_gather_order(position, hosts)]
    if not sg.is_leader:
        for part in sums:
            _host_sum(sg, part, timeout_s, average)
        for part in finals:
            _copy_out(sg, part, timeout_s)
        return flat
    what = "shm all_reduce (ring between hosts)"
    _host_sum(sg, sums[0], timeout_s, average)
    ring.reduce_scatter(flat, sg.group, timeout_s, what=what, members=sg.leaders,
                        meanwhile=lambda step: _host_sum(sg, sums[step + 1], timeout_s, average))
    ring.all_gather(flat, sg.group, timeout_s, what=what, members=sg.leaders,
                    meanwhile=lambda step: _copy_out(sg, finals[step], timeout_s))
    _copy_out(sg, finals[-1], timeout_s)
    return flat
