"""How a flat tensor is cut into one shard per rank, and a shard into chunks.

Every algorithm uses the same cut, so ``reduce_scatter`` leaves rank ``r`` holding shard ``r`` whichever
algorithm produced it, and ``all_gather`` can complete it with another::

    >>> shard_bounds(100, 3, align=16)
    [(0, 48), (48, 96), (96, 100)]
"""

from __future__ import annotations

__all__ = ["shard_bounds", "tensor_shards", "chunk_bounds", "ALIGN_BYTES"]

ALIGN_BYTES = 64
"""Shard boundaries fall on cache lines: two cores writing neighbouring shards never share a line,
and vectorised kernels start aligned."""


def shard_bounds(numel: int, world_size: int, align: int = 1) -> list[tuple[int, int]]:
    """``world_size`` contiguous ``(start, end)`` ranges covering ``[0, numel)``.

    Every shard but the last ones has the same length, a multiple of ``align`` elements; trailing
    shards may be shorter or empty (``numel`` smaller than ``world_size * align``). Every rank computes the
    same bounds from the same two numbers, which is what lets senders and receivers agree without talking.

    >>> shard_bounds(7, 3)
    [(0, 3), (3, 6), (6, 7)]
    >>> shard_bounds(2, 4)
    [(0, 1), (1, 2), (2, 2), (2, 2)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    per_shard = -(-numel // world_size)  # ceil
    per_shard = -(-per_shard // align) * align
    return [(min(numel, r * per_shard), min(numel, (r + 1) * per_shard)) for r in range(world_size)]


def tensor_shards(flat, world_size: int) -> list[tuple[int, int]]:
    """The cut every ringtrain algorithm uses for the 1-D tensor ``flat``: shards start on cache lines.

    >>> tensor_shards(torch.zeros(100), 3)      # float32: 16 elements per 64-byte line
    [(0, 48), (48, 96), (96, 100)]
    """
    return shard_bounds(flat.numel(), world_size, align=max(1, ALIGN_BYTES // flat.element_size()))


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ranges of at most ``chunk`` elements (none when it is empty).

    >>> chunk_bounds(0, 10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 element, got {chunk}")
    return [(lo, min(end, lo + chunk)) for lo in range(start, end, chunk)]
