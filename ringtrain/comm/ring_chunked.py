"""Pipelined ring all-reduce: every shard cut into chunks that flow around the ring independently.

The plain ring (``ring.py``) moves a whole shard, then reduces it, then moves the next: while a rank adds,
nothing is on the wire. Here each shard is cut into chunks of ``chunk_bytes``; a chunk is forwarded to the
right neighbour as soon as it has been reduced, and the next ``depth`` chunks are already in flight while
this one is added. The steps, the data sent and the result are exactly those of the plain ring (same
shards, same order of additions, bit-identical on every rank); only the timing differs.

Every message is posted as a send/receive pair (``batch_isend_irecv``) in the same order on all ranks, so
NCCL, which serialises the point-to-point operations between two ranks, sees matching pairs and cannot
deadlock; Gloo gets a distinct tag per message::

    >>> from ringtrain.comm import ring_chunked
    >>> ring_chunked.all_reduce(flat, group, timeout_s=60.0, chunk_bytes=1 << 20)
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ringtrain.comm.ring import RingPeers
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.scratch import scratch

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "DEFAULT_CHUNK_BYTES", "DEFAULT_DEPTH"]

DEFAULT_CHUNK_BYTES = 4 << 20
"""Measured on the 2-core development machine (Gloo over loopback, 2 ranks, 16 to 64 MB, busbw over
Gloo's, medians per size): 4 MB chunks 1.04x to 1.08x (six runs), 2 MB 1.02x to 1.09x (four runs), 1 MB
0.81x to 0.92x (three runs). See docs/benchmarks.md."""

DEFAULT_DEPTH = 2
"""Chunks in flight while one is being reduced."""


def all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Sum the contiguous 1-D ``flat`` over ``group`` in place."""
    _pipeline(flat, RingPeers(group, timeout_s, "ring_chunked all_reduce"), chunk_bytes, reduce=True, gather=True)
    return flat


def reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Sum ``flat`` so that this rank's shard holds the total; return the shard (other shards: partial sums)."""
    ring = RingPeers(group, timeout_s, "ring_chunked reduce_scatter")
    _pipeline(flat, ring, chunk_bytes, reduce=True, gather=False)
    lo, hi = tensor_shards(flat, ring.size)[ring.rank]
    return flat[lo:hi]


def all_gather(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Given this rank's shard of ``flat``, fill in every other rank's shard in place."""
    _pipeline(flat, RingPeers(group, timeout_s, "ring_chunked all_gather"), chunk_bytes, reduce=False, gather=True)
    return flat


def _pipeline(flat: torch.Tensor, ring: RingPeers, chunk_bytes: int, reduce: bool, gather: bool, depth: int = DEFAULT_DEPTH) -> None:
    n, r = ring.size, ring.rank
    bounds = tensor_shards(flat, n)
    # Stage t receives shard recv[t] from the left and sends shard send[t] to the right. Reduce-scatter
    # stages add what arrives; all-gather stages store it in place. What stage t received is exactly
    # what stage t + 1 sends: a chunk can move on as soon as it has been handled.
    send, recv, adds = [], [], []
    if reduce:
        for step in range(n - 1):
            send.append((r - step - 1) % n)
            recv.append((r - step - 2) % n)
            adds.append(True)
    if gather:
        for step in range(n - 1):
            send.append((r - step) % n)
            recv.append((r - step - 1) % n)
            adds.append(False)
    chunk = max(1, chunk_bytes // flat.element_size())
    columns = max(1, -(-max(hi - lo for lo, hi in bounds) // chunk))  # chunks per shard
    stages = len(send)
    items = stages * columns  # item i = (stage i // columns, chunk i % columns)
    # Item i + lookahead may be posted once item i is handled: its data is item i + lookahead - columns.
    lookahead = max(1, min(depth, columns))
    buffers = [scratch(chunk, flat.dtype, flat.device, slot=1 + b) for b in range(lookahead + 1)]

    def region(shard: int, column: int) -> tuple[int, int]:
        lo, hi = bounds[shard]
        start = min(hi, lo + column * chunk)
        return start, min(hi, start + chunk)

    posted: deque = deque()
    sends: list = []

    def post(item: int) -> None:
        stage, column = divmod(item, columns)
        s_lo, s_hi = region(send[stage], column)
        r_lo, r_hi = region(recv[stage], column)
        target = buffers[item % len(buffers)][: r_hi - r_lo] if adds[stage] else flat[r_lo:r_hi]
        send_works, recv_works = ring.post(flat[s_lo:s_hi], target, tag=item)
        sends.extend((work, stage) for work in send_works)
        posted.append((item, recv_works, target, r_lo, r_hi))

    next_item = 0
    while next_item < min(lookahead, items):
        post(next_item)
        next_item += 1
    while posted:
        item, recv_works, target, r_lo, r_hi = posted.popleft()
        stage = item // columns
        for work in recv_works:
            ring.wait(work, ring.left, stage + 1, stages)
        if adds[stage] and r_hi > r_lo:
            flat[r_lo:r_hi].add_(target)
        # Keep `lookahead` items in flight; the next one's data was handled at least one item ago.
        while next_item < items and next_item <= item + lookahead:
            post(next_item)
            next_item += 1
    for work, stage in sends:
        ring.wait(work, ring.right, stage + 1, stages)
