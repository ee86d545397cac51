"""The collectives other than the sum all-reduce on one host's shared memory, for the ``ringtrain_shm`` c10d
backend (``c10d_backend.py``): all-gather, reduce-scatter (sum, avg, max, min, product), broadcast, all-to-all
with uneven splits, the all-reduce's other ops and dtypes, and a barrier.

They run on the workspace the all-reduce set up (``shm_group.py``): each call is a sequence of rounds; in a
round every rank writes its part into its own ``staging`` buffer (the next of the two, ``staging_turn``),
arrives at the flag board's barrier, and reads what it needs from its peers' buffers. One barrier per round is
enough for the reason the staged all-reduce gives: a rank writes buffer b again only after a later barrier,
which every peer reaches only once done reading b. The first barrier carries the call's descriptor, so ranks
that call different collectives fail naming each other; a peer that dies or stops is named by the board as in
the all-reduce (with the op in the message).

Byte copies (gathers, broadcasts, all-to-all) are dtype-free; reductions run torch's element-wise ops on typed
views of the buffers, adding the ranks' parts in rank order, so every rank that reduces the same elements gets
bit-identical results (complex numbers through their real view). The caller checks sizes and dtypes before
anything is written (``c10d_backend``: what does not fit goes to Gloo); every function here takes contiguous
CPU tensors of one dtype and a ShmGroup whose ranks are all on this host (``local_size == size``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ringtrain.comm.shm_board import encode_call
from ringtrain.comm.shm_group import ShmGroup

__all__ = ["REDUCTIONS", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier"]

REDUCTIONS: dict[str, Callable] = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum,
                                   "product": torch.mul}
"""The element-wise op of each reduction (``avg``: the sum, divided by the world size at the end)."""
_LINE = 64


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D byte view of a contiguous tensor (any dtype, any shape, zero-dimensional too)."""
    flat = tensor.reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _typed(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view that reductions run on: complex numbers as pairs of reals."""
    flat = tensor.reshape(-1)
    return torch.view_as_real(flat).reshape(-1) if flat.dtype.is_complex else flat


def _rounds(sg: ShmGroup, what: str, desc: tuple[int, int, int], rounds: int, timeout_s: float,
            write: Callable[[int, torch.Tensor], None], read: Callable[[int, list[torch.Tensor]], None]) -> None:
    """``rounds`` rounds (at least one, so that ranks calling different collectives meet and are told):
    ``write(k, mine)`` fills this rank's staging buffer, ``read(k, buffers)`` reads every rank's."""
    board = sg.board
    rounds = max(1, rounds)
    for k in range(rounds):
        sg.turns.staging_turn ^= 1
        buffers = sg.region_views("staging", sg.turns.staging_turn, torch.uint8)
        write(k, buffers[sg.local_rank])
        count = board.arrive(desc if k == 0 else None)
        board.wait_all(count, what, k + 1, rounds, timeout_s)
        if k == 0:
            board.check_same_call(count, desc, what)
        read(k, buffers)


def _slot_bytes(sg: ShmGroup) -> int:
    """Bytes per peer in one round when a rank's buffer holds one slot per rank (cache-line aligned, so a multiple
    of every element size); 0 when the staging buffer is too small for a line per rank (``fits``)."""
    return sg.piece_bytes // sg.local_size // _LINE * _LINE


def fits(sg: ShmGroup) -> bool:
    """Whether these collectives can run on ``sg``: all its ranks on this host, a cache line per rank in a
    staging buffer and room for an all-to-all's header (``init_shm(piece_kb=1)`` with 13 ranks or more has not)."""
    return not sg.hierarchical and sg.local_size == sg.size and _slot_bytes(sg) > 0 and _a2a_layout(sg)[1] > 0


def all_gather(sg: ShmGroup, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout_s: float) -> None:
    """``outputs[j]`` = rank j's ``tensor`` (all of ``tensor``'s size and dtype); ``outputs[me]`` may be ``tensor``."""
    me = sg.local_rank
    source = _bytes(tensor)
    targets = [_bytes(out) for out in outputs]
    total, piece = source.numel(), sg.piece_bytes

    def write(k: int, mine: torch.Tensor) -> None:
        part = source[k * piece : (k + 1) * piece]
        mine[: part.numel()].copy_(part)

    def read(k: int, buffers: list[torch.Tensor]) -> None:
        lo, hi = k * piece, min(total, (k + 1) * piece)
        for j, target in enumerate(targets):
            if j != me and hi > lo:
                target[lo:hi].copy_(buffers[j][: hi - lo])

    desc = encode_call("all_gather", "sum", tensor.dtype, tensor.numel())
    _rounds(sg, "shm all_gather", desc, -(-total // piece), timeout_s, write, read)
    if targets[me].data_ptr() != source.data_ptr():
        targets[me].copy_(source)


def reduce_scatter(sg: ShmGroup, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str, timeout_s: float) -> None:
    """``output`` = the reduction over ranks of their ``inputs[me]`` (``op``: a key of ``REDUCTIONS``), added
    in rank order; ``output`` may be this rank's ``inputs[me]``."""
    n, me = sg.local_size, sg.local_rank
    sources = [_bytes(t) for t in inputs]
    result = _typed(output)
    element = result.element_size()
    slot = _slot_bytes(sg)
    total = sources[0].numel()
    combine = REDUCTIONS[op]

    def write(k: int, mine: torch.Tensor) -> None:
        lo, hi = k * slot, min(total, (k + 1) * slot)
        for j, source in enumerate(sources):
            if hi > lo:
                mine[j * slot : j * slot + hi - lo].copy_(source[lo:hi])

    def read(k: int, buffers: list[torch.Tensor]) -> None:
        lo, hi = k * slot, min(total, (k + 1) * slot)
        if hi > lo:
            parts = [buffers[j][me * slot : me * slot + hi - lo].view(result.dtype) for j in range(n)]
            _reduce_into(result[lo // element : hi // element], parts, combine)

    desc = encode_call("reduce_scatter", op, output.dtype, output.numel())
    _rounds(sg, f"shm reduce_scatter({op})", desc, -(-total // slot), timeout_s, write, read)
    if op == "avg":
        output.div_(n)  # complex numbers as complex: torch's (and Gloo's) rounding


def all_reduce(sg: ShmGroup, tensor: torch.Tensor, op: str, timeout_s: float) -> None:
    """Reduce ``tensor`` over the ranks in place: every rank reduces every element, in rank order, so all
    ranks hold bit-identical results (the all-reduces the native sum does not take: other ops and dtypes)."""
    n = sg.local_size
    data = _bytes(tensor)
    result = _typed(tensor)
    element = result.element_size()
    piece = sg.piece_bytes
    total = data.numel()
    combine = REDUCTIONS[op]

    def write(k: int, mine: torch.Tensor) -> None:
        part = data[k * piece : (k + 1) * piece]
        mine[: part.numel()].copy_(part)

    def read(k: int, buffers: list[torch.Tensor]) -> None:
        lo, hi = k * piece, min(total, (k + 1) * piece)
        if hi > lo:
            _reduce_into(result[lo // element : hi // element], [b[: hi - lo].view(result.dtype) for b in buffers], combine)

    desc = encode_call("all_reduce", op, tensor.dtype, tensor.numel())
    _rounds(sg, f"shm all_reduce({op})", desc, -(-total // piece), timeout_s, write, read)
    if op == "avg":
        tensor.div_(n)


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], combine: Callable) -> None:
    combine(parts[0], parts[1], out=out)
    for part in parts[2:]:
        combine(out, part, out=out)


def broadcast(sg: ShmGroup, tensor: torch.Tensor, root: int, timeout_s: float) -> None:
    """Every rank's ``tensor`` = rank ``root``'s."""
    me = sg.local_rank
    data = _bytes(tensor)
    piece, total = sg.piece_bytes, data.numel()

    def write(k: int, mine: torch.Tensor) -> None:
        if me == root:
            part = data[k * piece : (k + 1) * piece]
            mine[: part.numel()].copy_(part)

    def read(k: int, buffers: list[torch.Tensor]) -> None:
        lo, hi = k * piece, min(total, (k + 1) * piece)
        if me != root and hi > lo:
            data[lo:hi].copy_(buffers[root][: hi - lo])

    desc = encode_call("broadcast", "sum", tensor.dtype, tensor.numel(), root)
    _rounds(sg, "shm broadcast", desc, -(-total // piece), timeout_s, write, read)


def all_to_all(sg: ShmGroup, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], dtype: torch.dtype,
               timeout_s: float) -> None:
    """Rank i's ``inputs[j]`` lands in rank j's ``outputs[i]`` (1-D byte or typed views, any sizes). The first
    round carries every rank's sizes in a header before its data: every rank checks the whole matrix (what each
    rank sends against what its receiver expects) before it reads, so all fail together, in one line, when two
    ranks disagree, and all know how many rounds the largest part takes. A rank's part for itself never goes
    through the buffers."""
    n, me = sg.local_size, sg.local_rank
    sources = [_bytes(t) for t in inputs]
    targets = [_bytes(t) for t in outputs]
    sizes = torch.tensor([s.numel() for s in sources] + [t.numel() for t in targets], dtype=torch.int64)
    header, slot = _a2a_layout(sg)
    what = "shm all_to_all"
    desc = encode_call("all_to_all", "sum", dtype, n)
    board = sg.board
    rounds, k = 1, 0
    while k < rounds:
        sg.turns.staging_turn ^= 1
        buffers = sg.region_views("staging", sg.turns.staging_turn, torch.uint8)
        mine = buffers[me]
        if k == 0:
            mine[: sizes.numel() * 8].copy_(sizes.view(torch.uint8))
        lo = k * slot
        for j, source in enumerate(sources):
            part = source[lo : lo + slot]
            if j != me and part.numel():
                at = header + j * slot
                mine[at : at + part.numel()].copy_(part)
        count = board.arrive(desc if k == 0 else None)
        board.wait_all(count, what, k + 1, rounds, timeout_s)
        if k == 0:
            board.check_same_call(count, desc, what)
            rounds = _a2a_rounds(sg, torch.stack([b[: sizes.numel() * 8].view(torch.int64) for b in buffers]), slot,
                                 what)
        for j, target in enumerate(targets):
            part = target[lo : lo + slot]
            if j != me and part.numel():
                at = header + me * slot
                part.copy_(buffers[j][at : at + part.numel()])
        k += 1
    targets[me].copy_(sources[me])


def _a2a_layout(sg: ShmGroup) -> tuple[int, int]:
    """(header, slot) of an all-to-all round in a staging buffer: the header holds a rank's 2n sizes (first round
    only), then a cache-line-aligned slot per peer."""
    header = -(-2 * sg.local_size * 8 // _LINE) * _LINE
    return header, (sg.piece_bytes - header) // sg.local_size // _LINE * _LINE


def _a2a_rounds(sg: ShmGroup, table: torch.Tensor, slot: int, what: str) -> int:
    """The rounds an all-to-all takes, from every rank's sizes (row i: rank i's n sends, then its n receives);
    ValueError, the same on every rank, when a rank sends other than its receiver expects."""
    n = sg.local_size
    sends = table[:, :n]  # sends[i, j]: bytes rank i sends to rank j
    receives = table[:, n:].T  # receives[i, j]: bytes rank j expects from rank i
    if not torch.equal(sends, receives):
        i, j = (sends != receives).nonzero()[0].tolist()
        raise ValueError(f"{what}: rank {sg.local[i]} sends {sends[i, j]} bytes to rank {sg.local[j]}, which expects "
                         f"{receives[i, j]}; every rank's output split sizes must match its peers' input split sizes")
    through_buffers = sends.clone()
    through_buffers.fill_diagonal_(0)  # a rank's part for itself is copied directly
    return max(1, -(-int(through_buffers.max()) // slot))


def barrier(sg: ShmGroup, timeout_s: float) -> None:
    """Return once every rank of the group has arrived."""
    desc = encode_call("barrier", "sum", torch.uint8, 0)
    count = sg.board.arrive(desc)
    sg.board.wait_all(count, "shm barrier", 1, 1, timeout_s)
    sg.board.check_same_call(count, desc, "shm barrier")
