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

from ringtrain.comm.errors import CollectiveError
from ringtrain.comm.groups import resolve_group
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.shm_board import encode_call
from ringtrain.comm.shm_group import (
    MIN_PIECE_BYTES, NATIVE_IN_PLACE_BYTES, PIECE_BYTES, SMALL_BYTES, ShmGroup, get_shm_group, set_up, set_up_group,
)

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
        from ringtrain.comm import hierarchical

        return hierarchical.all_reduce(sg, flat, timeout_s, average)
    return local_all_reduce(sg, flat, timeout_s, average, sg.size)


def reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, average: bool = False) -> torch.Tensor:
    """Reduce ``flat`` so that this rank's shard (``tensor_shards``) holds the result; return the shard."""
    sg = get_shm_group(group)
    lo, hi = tensor_shards(flat, sg.size)[sg.rank]
    if sg.hierarchical:  # shards are per group rank, hosts are not: reduce everything, keep the shard
        all_reduce(flat, group, timeout_s, average)
        return flat[lo:hi]
    _staged(sg, flat, timeout_s, average, reduce=True, gather=False, what="shm reduce_scatter")
    return flat[lo:hi]


def all_gather(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float) -> torch.Tensor:
    """Fill every rank's shard of ``flat`` from its owner, in place."""
    sg = get_shm_group(group)
    if sg.hierarchical:
        from ringtrain.comm import ring

        return ring.all_gather(flat, group, timeout_s, what="shm all_gather (ring across hosts)")
    _staged(sg, flat, timeout_s, False, reduce=False, gather=True, what="shm all_gather")
    return flat


def native_error(group: dist.ProcessGroup | None, tensor: torch.Tensor, average: bool,
                 timeout_s: float | None) -> CollectiveError:
    """The error of a failed ``Workspace.run`` (``comm.all_reduce``'s hot path) of ``tensor`` over ``group``."""
    sg = get_shm_group(resolve_group(group))
    desc = encode_call("all_reduce", "avg" if average else "sum", tensor.dtype, tensor.numel())
    return sg.board.native_failure(sg.native.failure(), desc, "shm all_reduce", timeout_s or sg.timeout_s)


def local_all_reduce(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, divide_by: int) -> torch.Tensor:
    """All-reduce among the ranks of this host; ``average`` divides by ``divide_by`` first."""
    if sg.local_size == 1:  # alone on this host (hierarchical groups)
        return flat.div_(divide_by) if average else flat
    if sg.native is not None and flat.dtype in sg.native_dtypes:
        return native_all_reduce(sg, flat, timeout_s, average, divide_by)
    nbytes = flat.numel() * flat.element_size()
    if nbytes <= sg.small_bytes:
        return _direct(sg, flat, timeout_s, average, divide_by)
    found = sg.find_arena(flat)
    if found is not None:
        return _in_place(sg, flat, *found, timeout_s, average, divide_by)
    return _pipelined(sg, flat, timeout_s, average, divide_by)


def broadcast_from_leader(sg: ShmGroup, flat: torch.Tensor, timeout_s: float) -> torch.Tensor:
    """Copy the host leader's ``flat`` into every local rank's ``flat`` (one barrier per piece)."""
    what = "shm all_reduce (broadcast in host)"
    piece = sg.piece_bytes // flat.element_size()
    desc = encode_call("broadcast", "sum", flat.dtype, flat.numel())
    board = sg.board
    for step, lo in enumerate(range(0, flat.numel(), piece)):
        part = flat[lo : lo + piece]
        sg.turns.staging_turn ^= 1
        leader_buffer = sg.region_views("staging", sg.turns.staging_turn, flat.dtype)[0][: part.numel()]
        if sg.local_rank == 0:
            leader_buffer.copy_(part)
        count = board.arrive(desc if step == 0 else None)
        board.wait_all(count, what, step + 1, -(-flat.numel() // piece), timeout_s)
        if step == 0:
            board.check_same_call(count, desc, what)
        if sg.local_rank != 0:
            part.copy_(leader_buffer)
    return flat


def native_all_reduce(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, divide_by: int) -> torch.Tensor:
    """All-reduce through the C++ path (``csrc/shm_native.cpp``): small messages directly, large ones
    pipelined through the staging buffers, or in place when ``flat`` lives in a ``shared_empty`` arena.
    ``flat``: contiguous, of any shape (see ``native_ready``)."""
    arena_ptr = stride = offset = 0
    if sg.arenas and flat.numel() * flat.element_size() >= NATIVE_IN_PLACE_BYTES:
        found = sg.find_arena(flat)
        if found is not None:
            arena, offset = found
            arena_ptr, stride = arena.bytes.data_ptr(), arena.stride
    if sg.native.all_reduce(flat, average, divide_by, timeout_s, arena_ptr, stride, offset):
        what = "shm all_reduce (in place)" if arena_ptr else "shm all_reduce"
        desc = encode_call("all_reduce", "avg" if average else "sum", flat.dtype, flat.numel(), offset if arena_ptr else -1)
        raise sg.board.native_failure(sg.native.failure(), desc, what, timeout_s)
    return flat


def _direct(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, divide_by: int) -> torch.Tensor:
    numel = flat.numel()
    sg.turns.small_turn ^= 1
    # Slicing views costs a microsecond each: keep them per (buffer, dtype, size, op).
    key = ("direct", sg.turns.small_turn, flat.dtype, numel, average)
    cached = sg._views.get(key)
    if cached is None:
        if len(sg._views) > 512:  # many distinct sizes: start over rather than grow without bound
            sg._views.clear()
        views = [v[:numel] for v in sg.region_views("small", sg.turns.small_turn, flat.dtype)]
        desc = encode_call("all_reduce", "avg" if average else "sum", flat.dtype, numel)
        cached = sg._views[key] = (views, desc)
    views, desc = cached
    mine = views[sg.local_rank]
    if average:
        torch.div(flat, divide_by, out=mine)  # divide on the way in: no fp16 overflow in the sum
    else:
        mine.copy_(flat)
    board = sg.board
    count = board.arrive(desc)
    board.wait_all(count, "shm all_reduce", 1, 1, timeout_s)
    board.check_same_call(count, desc, "shm all_reduce")
    # Every rank adds the same buffers in the same order: bit-identical results.
    torch.add(views[0], views[1], out=flat)
    for view in views[2:]:
        flat.add_(view)
    return flat


def _staged(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, reduce: bool, gather: bool,
            what: str, divide_by: int | None = None) -> torch.Tensor:
    """Reduce-scatter and/or all-gather through the staging buffers, ``piece_bytes`` per rank at a time.

    Shards are those of the whole tensor (``tensor_shards``), so a reduce-scatter leaves rank r's shard
    exactly where every other algorithm leaves it. Piece k carries, for every rank j, elements
    ``[k q, (k + 1) q)`` of shard j, stored at ``j q`` in the staging buffer (q = piece / ranks).
    """
    n, me = sg.local_size, sg.local_rank
    divide_by = divide_by or n
    bounds = tensor_shards(flat, n)
    q = _piece_elements(sg, flat)
    longest = max(hi - lo for lo, hi in bounds)
    pieces = max(1, -(-longest // q))
    desc = encode_call(what.split()[1], "avg" if average else "sum", flat.dtype, flat.numel())
    board = sg.board
    barriers = pieces * (int(reduce) + int(gather))
    barrier = 0
    my_lo, my_hi = bounds[me]
    if average:
        flat[my_lo:my_hi].div_(divide_by)  # this rank's own shard; the others are divided on the way in
    for k in range(pieces):
        sg.turns.staging_turn ^= 1
        staging = sg.region_views("staging", sg.turns.staging_turn, flat.dtype)
        parts = [(min(hi, lo + k * q), min(hi, lo + (k + 1) * q)) for lo, hi in bounds]
        if reduce:
            for j, (lo, hi) in enumerate(parts):  # the parts other ranks will sum
                if j != me and hi > lo:
                    out = staging[me][j * q : j * q + hi - lo]
                    if average:
                        torch.div(flat[lo:hi], divide_by, out=out)
                    else:
                        out.copy_(flat[lo:hi])
            barrier += 1
            count = board.arrive(desc if k == 0 else None)
            board.wait_all(count, what, barrier, barriers, timeout_s)
            if k == 0:
                board.check_same_call(count, desc, what)
            lo, hi = parts[me]
            mine = flat[lo:hi]
            for j in range(n):
                if j != me and hi > lo:
                    mine.add_(staging[j][me * q : me * q + hi - lo])
        if gather:
            lo, hi = parts[me]
            if hi > lo:
                staging[me][me * q : me * q + hi - lo].copy_(flat[lo:hi])
            barrier += 1
            count = board.arrive(desc if (k == 0 and not reduce) else None)
            board.wait_all(count, what, barrier, barriers, timeout_s)
            if k == 0 and not reduce:
                board.check_same_call(count, desc, what)
            for j, (lo, hi) in enumerate(parts):
                if j != me and hi > lo:
                    flat[lo:hi].copy_(staging[j][j * q : j * q + hi - lo])
    return flat


def _piece_elements(sg: ShmGroup, flat: torch.Tensor) -> int:
    """Elements of each rank's shard per piece: a sixteenth of the message, between MIN_PIECE_BYTES and the
    staging buffer. Small pieces stay in L2 while the peer reads them; large messages, which stream from
    memory anyway, do better with fewer pieces (fewer barriers, fewer switches between buffers)."""
    nbytes = flat.numel() * flat.element_size()
    piece = min(sg.piece_bytes, max(MIN_PIECE_BYTES, nbytes // 16))
    return max(1, piece // flat.element_size() // sg.local_size)


def _pipelined(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, divide_by: int) -> torch.Tensor:
    """Staged reduce-scatter + all-gather, software-pipelined: one barrier per piece instead of two.

    Between two barriers a rank copies out the finished shards of piece k - 2, reduces and publishes its
    shard of piece k - 1, and copies in piece k. Nothing collides: copying in writes the other ranks'
    slots of a buffer, publishing writes this rank's own slot, and a buffer comes back (piece k + 2)
    only after a barrier that every rank reaches once done with it.
    """
    what = "shm all_reduce"
    n, me = sg.local_size, sg.local_rank
    bounds = tensor_shards(flat, n)
    q = _piece_elements(sg, flat)  # elements of each shard per piece
    pieces = max(1, -(-max(hi - lo for lo, hi in bounds) // q))
    desc = encode_call("all_reduce", "avg" if average else "sum", flat.dtype, flat.numel())
    board = sg.board
    first_turn = sg.turns.staging_turn ^ 1
    sg.turns.staging_turn ^= pieces & 1  # the next call starts on the buffer after this call's last piece
    staging = [sg.region_views("staging", 0, flat.dtype), sg.region_views("staging", 1, flat.dtype)]

    def parts(k: int) -> list[tuple[int, int]]:
        return [(min(hi, lo + k * q), min(hi, lo + (k + 1) * q)) for lo, hi in bounds]

    def copy_in(k: int) -> None:  # the parts of piece k that the other ranks reduce
        mine = staging[first_turn ^ (k & 1)][me]
        for j, (lo, hi) in enumerate(parts(k)):
            if j != me and hi > lo:
                if average:
                    torch.div(flat[lo:hi], divide_by, out=mine[j * q : j * q + hi - lo])
                else:
                    mine[j * q : j * q + hi - lo].copy_(flat[lo:hi])

    def reduce_and_publish(k: int) -> None:
        buffers = staging[first_turn ^ (k & 1)]
        lo, hi = parts(k)[me]
        if hi > lo:
            mine = flat[lo:hi]
            if average:
                mine.div_(divide_by)
            for j in range(n):
                if j != me:
                    mine.add_(buffers[j][me * q : me * q + hi - lo])
            buffers[me][me * q : me * q + hi - lo].copy_(mine)

    def gather(k: int) -> None:
        buffers = staging[first_turn ^ (k & 1)]
        for j, (lo, hi) in enumerate(parts(k)):
            if j != me and hi > lo:
                flat[lo:hi].copy_(buffers[j][j * q : j * q + hi - lo])

    copy_in(0)
    count = board.arrive(desc)
    board.wait_all(count, what, 1, pieces + 1, timeout_s)
    board.check_same_call(count, desc, what)
    for k in range(1, pieces + 1):
        if k >= 2:
            gather(k - 2)
        reduce_and_publish(k - 1)
        if k < pieces:
            copy_in(k)
        count = board.arrive()
        board.wait_all(count, what, k + 1, pieces + 1, timeout_s)
    gather(pieces - 1)
    return flat


def _in_place(sg: ShmGroup, flat: torch.Tensor, arena, offset: int, timeout_s: float, average: bool,
              divide_by: int) -> torch.Tensor:
    """All-reduce of a tensor in shared memory: peers read each other's tensors, nothing is staged."""
    what = "shm all_reduce (in place)"
    n, me = sg.local_size, sg.local_rank
    numel = flat.numel()
    peers = [arena.view(j, offset, numel, flat.dtype) for j in range(n)]
    bounds = tensor_shards(flat, n)
    desc = encode_call("all_reduce", "avg" if average else "sum", flat.dtype, numel, offset)
    board = sg.board
    if average:
        flat.div_(divide_by)
    count = board.arrive(desc)
    board.wait_all(count, what, 1, 3, timeout_s)
    board.check_same_call(count, desc, what)
    lo, hi = bounds[me]
    mine = flat[lo:hi]
    for j in range(n):
        if j != me and hi > lo:
            mine.add_(peers[j][lo:hi])
    count = board.arrive()
    board.wait_all(count, what, 2, 3, timeout_s)
    for j, (lo, hi) in enumerate(bounds):
        if j != me and hi > lo:
            flat[lo:hi].copy_(peers[j][lo:hi])
    # Peers may still be copying this rank's shard: nobody returns (and overwrites) before all are done.
    count = board.arrive()
    board.wait_all(count, what, 3, 3, timeout_s)
    return flat
