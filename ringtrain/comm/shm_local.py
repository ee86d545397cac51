"""The shared-memory all-reduce inside one host: the algorithms ``shm.py`` dispatches to (direct for small
messages, staged reduce-scatter + all-gather in pipelined pieces for large ones, in place for tensors that live
in shared memory, and the C++ hot path), and the two primitives ``hierarchical.py`` builds on across hosts
(``local_all_reduce``, ``broadcast_from_leader``). Kept apart from ``shm.py`` so that the across-hosts code
imports the one-host code and not the front that dispatches to both (no import circle)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain.comm.errors import CollectiveError
from ringtrain.comm.groups import resolve_group
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.shm_board import encode_call
from ringtrain.comm.shm_group import MIN_PIECE_BYTES, NATIVE_IN_PLACE_BYTES, ShmGroup, get_shm_group

__all__ = ["local_all_reduce", "broadcast_from_leader", "native_all_reduce", "native_error", "staged"]


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


def staged(sg: ShmGroup, flat: torch.Tensor, timeout_s: float, average: bool, reduce: bool, gather: bool,
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
