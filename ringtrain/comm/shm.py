"""Shared-memory all-reduce for CPU ranks on one host: no sockets, no kernel, one copy in and out.

Every rank of a host maps the same workspace (``shm_group.py``) and meets the others through flags in it
(``shm_board.py``): a barrier costs a few hundred nanoseconds when ranks are in step, against tens of
microseconds for a TCP round trip.

- **Small messages** (up to ``SMALL_BYTES``) are reduced directly: each rank copies its tensor into its
  ``small`` buffer, arrives, waits for all, and sums every rank's buffer in rank order into its tensor.
  Same inputs, same order: bit-identical results. One barrier.
- **Large messages** are reduced as reduce-scatter + all-gather inside shared memory, in pieces that fit
  the ``staging`` buffers: each rank copies the parts of its tensor that other ranks reduce, arrives,
  adds everyone's copies of its own shard into its tensor, publishes that shard, arrives, and copies the
  others' finished shards. Each rank touches 1/n of the sums; every shard is summed once and copied, so
  again bit-identical. Software-pipelined (``_pipelined``): one barrier per piece.
- **Tensors that already live in shared memory** (``shared_empty``, e.g. the manual strategy's gradient
  buckets) skip the copies: peers read each other's tensors directly. Three barriers, the last one because
  a rank may overwrite its tensor as soon as the call returns.

**Native path.** Where the C++ module of ``shm_native.py`` loads on every rank of the host, all-reduces of
the dtypes it covers (float32/64, bfloat16, float16, int32/64) run the same protocol in C++ (``_native``):
one Python call, the GIL released, the sums vectorised, pieces of ``NATIVE_PIECE_BYTES``, and waits that
sleep on a futex until the peer's arrival wakes them (ranks sharing cores hand the core over). Other dtypes,
``RINGTRAIN_SHM_NATIVE=0`` and machines without a compiler take the Python code below.

Why double buffering is enough: a rank writes buffer b again two calls (or pieces) after it last did; in
between it passed a barrier that every rank reaches only after finishing with buffer b.

Across hosts, ``hierarchical.py`` combines this with a ring between host leaders::

    >>> from ringtrain.comm import shm
    >>> shm.init_shm(hosts=["a", "a", "b", "b"])        # optional: the default puts ranks on hosts by name
    >>> shm.all_reduce(flat, dist.group.WORLD, timeout_s=60.0, average=True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringtrain.comm import hierarchical, ring
from ringtrain.comm.groups import resolve_group
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.shm_group import PIECE_BYTES, SMALL_BYTES, ShmGroup, get_shm_group, set_up
from ringtrain.comm.shm_local import broadcast_from_leader, local_all_reduce, native_all_reduce, native_error, staged

__all__ = [
    "init_shm", "shared_empty", "all_reduce", "reduce_scatter", "all_gather", "broadcast_from_leader", "native_error",
    "native_all_reduce",
]


MAX_BUFFER_KB = 1 << 20
"""The largest small or staging buffer ``init_shm`` takes (1 GB; the workspace holds two of each per rank)."""


def init_shm(
    group: dist.ProcessGroup | None = None,
    hosts: Sequence[str] | None = None,
    small_kb: int = SMALL_BYTES >> 10,
    piece_kb: int = PIECE_BYTES >> 10,
) -> ShmGroup:
    """Collective: set up shared memory for ``group`` (otherwise done on its first shm collective).

    ``hosts``: one host name per group rank; ranks with the same name share memory, the others are
    reached through a ring between host leaders. Default: the machines' host names.
    ``small_kb``, ``piece_kb``: the sizes of each rank's small and staging buffers, 1 KB to 1 GB (the
    workspace holds two of each per rank); checked here, before anything reaches the native code, which
    cannot work with an empty buffer (``piece_kb=0`` made it write past its staging buffers).
    """
    for name, value in (("small_kb", small_kb), ("piece_kb", piece_kb)):
        _check_size(f"init_shm: {name}", value, 1, MAX_BUFFER_KB)
    return set_up(resolve_group(group), hosts, small_kb << 10, piece_kb << 10)


def _check_size(what: str, value: object, lowest: int, highest: int) -> None:
    """ValueError, in one line naming ``what``, unless ``value`` is a whole number in [lowest, highest]."""
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
        raise ValueError(f"{what} must be a whole number in [{lowest}, {highest}], got {value!r}")


def shared_empty(numel: int, dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Collective: a 1-D tensor in this host's shared memory that shm collectives reduce without copying.

    >>> bucket = shm.shared_empty(1 << 20)          # same call, same order, on every rank of the group
    >>> comm.all_reduce(bucket, algorithm="shm")    # peers read it in place
    """
    _check_size("shared_empty: numel", numel, 0, 1 << 40)
    return get_shm_group(resolve_group(group)).shared_empty(numel, dtype)


def all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Sum (or average) the contiguous 1-D CPU tensor ``flat`` over ``group`` in place."""
    sg = get_shm_group(group)
    if sg.native is not None and flat.dtype in sg.native_dtypes and not sg.hierarchical:
        return native_all_reduce(sg, flat, timeout_s, average, sg.size)  # the hot path: nothing else on the way
    if sg.hierarchical:
        return hierarchical.all_reduce(sg, flat, timeout_s, average)
    return local_all_reduce(sg, flat, timeout_s, average, sg.size)


def reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Reduce ``flat`` so that this rank's shard (``tensor_shards``) holds the result; return the shard."""
    sg = get_shm_group(group)
    lo, hi = tensor_shards(flat, sg.size)[sg.rank]
    if sg.hierarchical:  # shards are per group rank, hosts are not: reduce everything, keep the shard
        all_reduce(flat, group, timeout_s, average)
        return flat[lo:hi]
    staged(sg, flat, timeout_s, average, reduce=True, gather=False, what="shm reduce_scatter")
    return flat[lo:hi]


def all_gather(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float) -> torch.Tensor:
    """Fill every rank's shard of ``flat`` from its owner, in place."""
    sg = get_shm_group(group)
    if sg.hierarchical:
        return ring.all_gather(flat, group, timeout_s, what="shm all_gather (ring across hosts)")
    staged(sg, flat, timeout_s, False, reduce=False, gather=True, what="shm all_gather")
    return flat
