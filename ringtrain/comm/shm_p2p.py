"""Point-to-point messages on one host's shared memory, for the ``ringtrain_shm`` c10d backend's ``send`` /
``recv`` (and so ``batch_isend_irecv``, which torch's pipelining uses).

The flag board's counters (``shm_board.py``) are group-wide barriers: two ranks bumping them would leave every
other rank's next collective waiting. Point-to-point has a segment of its own, made with the group's workspace
(collectively, ``Channels(sg)``): one channel per ordered pair of local ranks (i, j), i != j::

    line 0   written by i only: seq (pieces posted, ever), and the current message's bytes, tag, dtype code
    line 1   written by j only: ack (pieces consumed, ever)
    slot     ``slot_bytes`` of the message; larger messages go in pieces, one in the slot at a time

The sender writes a piece only while the slot is free (``ack == seq``), then bumps ``seq`` (last: on x86's total
store order a receiver that sees the new count sees the piece, as on the board); the receiver copies the piece
out, then bumps ``ack``. A message is at least one piece (zero bytes too), so every send meets its recv, and
the receiver checks the sender's size, dtype and tag against its own on the first piece (a mismatch fails in
one line naming both). Messages between one pair in one direction are matched in the order they were posted,
as torch requires of ``batch_isend_irecv``.

Nothing blocks when posted: a send or recv moves what it can at once, and the rest moves while any of this
rank's operations is waited on (``wait`` drives every pending one, in posting order per peer and direction).
So two peers that both post a send larger than the slot, then their recvs, then wait (``batch_isend_irecv``)
never deadlock. A wait fails like the collectives: a dead peer within milliseconds, a stopped one at the group's
timeout, each named in one line with the op, posted on the board's abort line so the group's other ranks fail
naming the same rank.
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from ringtrain.comm.errors import MismatchError
from ringtrain.comm.shm_board import _DIED, _DTYPES, _MISMATCH, _TIMEOUT, encode_call

__all__ = ["Channels", "SLOT_BYTES"]

SLOT_BYTES = 256 << 10
"""Bytes of one channel's slot: a 1 MB pipeline activation crosses in four hand-overs."""
_HEADER = 128  # two 64-byte lines: the sender's, the receiver's
_SEQ, _NBYTES, _TAG, _CODE = 0, 1, 2, 3  # words of the sender's line
_ACK = 8  # the receiver's line
_LIVENESS_EVERY_S = 0.02


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _dtype_name(code: int) -> str:
    index = code % 1_000
    return str(_DTYPES[index]).replace("torch.", "") if 0 <= index < len(_DTYPES) else "?"


class _Op:
    """One posted send or recv: ``step()`` moves what it can without waiting."""

    __slots__ = ("channels", "kind", "peer", "data", "tag", "code", "pieces", "k", "words", "base", "slot", "entry",
                 "desc")

    def __init__(self, channels: Channels, kind: str, peer: int, tensor: torch.Tensor, tag: int, entry):
        self.channels, self.kind, self.peer, self.tag, self.entry = channels, kind, peer, tag, entry
        self.data = _bytes(tensor)
        self.desc = encode_call("broadcast", "sum", tensor.dtype, tensor.numel())  # only its dtype code is used
        self.code = self.desc[1]
        slot = channels.slot_bytes
        self.pieces = max(1, -(-self.data.numel() // slot))
        self.k = 0
        me = channels.local_rank
        index = me * channels.n + peer if kind == "send" else peer * channels.n + me
        self.base = index * channels.stride // 8
        self.slot = channels.bytes[index * channels.stride + _HEADER : (index + 1) * channels.stride]
        self.words = channels.words

    @property
    def done(self) -> bool:
        return self.k >= self.pieces

    def step(self) -> bool:
        """Move the pieces that can move now; True if any did."""
        words, base, size = self.words, self.base, self.channels.slot_bytes
        moved = False
        while self.k < self.pieces:
            seq, ack = words[base + _SEQ], words[base + _ACK]
            lo = self.k * size
            part = self.data[lo : lo + size]
            if self.kind == "send":
                if seq != ack:
                    return moved  # the receiver has not taken the last piece yet
                if self.k == 0:
                    words[base + _NBYTES], words[base + _TAG], words[base + _CODE] = self.data.numel(), self.tag, self.code
                self.slot[: part.numel()].copy_(part)
                words[base + _SEQ] = seq + 1  # last (TSO): a receiver that sees it sees the piece
            else:
                if seq == ack:
                    return moved  # nothing posted yet
                if self.k == 0:
                    self._check(words[base + _NBYTES], words[base + _TAG], words[base + _CODE])
                part.copy_(self.slot[: part.numel()])
                words[base + _ACK] = ack + 1
            self.k += 1
            moved = True
        return moved

    def _check(self, nbytes: int, tag: int, code: int) -> None:
        if (nbytes, tag, code) == (self.data.numel(), self.tag, self.code):
            return
        ch = self.channels
        board = ch.sg.board
        board._post_abort(self.peer, _MISMATCH, 1)
        theirs, mine = _dtype_name(code), _dtype_name(self.code)
        raise MismatchError(
            f"shm recv: rank {ch.ranks[self.peer]} sent {nbytes} bytes of {theirs} with tag {tag} while rank "
            f"{ch.ranks[ch.local_rank]} expected {self.data.numel()} bytes of {mine} with tag {self.tag}; each recv "
            "must match its send's size, dtype and tag, in the order the sends were posted",
            peer=ch.ranks[self.peer],
        )


class Channels:
    """This rank's view of a group's point-to-point segment (made collectively, with the workspace)."""

    def __init__(self, sg, slot_bytes: int | None = None):
        """``slot_bytes``: default the smaller of ``SLOT_BYTES`` and the workspace's staging piece (so that
        ``init_shm(piece_kb=4)`` makes 4 KB slots too)."""
        slot_bytes = slot_bytes or min(SLOT_BYTES, sg.piece_bytes) // 64 * 64 or 64
        self.sg = sg
        self.n = sg.local_size
        self.local_rank = sg.local_rank
        self.ranks = sg.board.ranks
        self.slot_bytes = slot_bytes
        self.stride = _HEADER + slot_bytes
        self.segment = sg.share_segment(max(1, self.n * self.n) * self.stride, "p2p")
        self.bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.words = memoryview(self.segment.buf).cast("q")
        self.queues: dict[tuple[str, int], deque[_Op]] = {}
        """Pending ops per (kind, local peer), in posting order: only the first of each may move."""

    def close(self) -> None:
        self.queues.clear()
        self.words.release()
        self.bytes = None
        self.segment.close()

    def post(self, kind: str, peer: int, tensor: torch.Tensor, tag: int, entry) -> _Op:
        """Post a send to (or recv from) local rank ``peer``; it moves what it can now."""
        op = _Op(self, kind, peer, tensor, tag, entry)
        queue = self.queues.setdefault((kind, peer), deque())
        queue.append(op)
        self.progress()
        return op

    def progress(self) -> bool:
        """Move every pending op as far as it can go now; True if anything moved."""
        moved = False
        for queue in self.queues.values():
            while queue:
                head = queue[0]
                moved |= head.step()
                if not head.done:
                    break
                queue.popleft()
                from ringtrain.comm import flight

                flight.recorder().end(head.entry)
        return moved

    def wait(self, op: _Op, timeout_s: float) -> None:
        """Drive every pending op until ``op`` is done; raise CollectiveError naming the peer that died, stopped or
        never came (and post it on the board's abort line)."""
        board = self.sg.board
        flags = board.flags
        start = time.monotonic()
        next_check = start + _LIVENESS_EVERY_S
        pause_s = 20e-6
        what = f"shm {op.kind}"
        while not op.done:
            if self.progress():
                pause_s = 20e-6
                continue
            if flags[board.abort_line]:
                raise board._aborted(what, op.k + 1, op.pieces)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                state = board._state(op.peer)
                if state == "dead":
                    self.progress()
                    if op.done:
                        return
                    board._post_abort(op.peer, _DIED, op.k + 1)
                    raise board._died(op.peer, what, op.k + 1, op.pieces)
                if now - start >= timeout_s:
                    board._post_abort(op.peer, _TIMEOUT, op.k + 1)
                    raise board._timed_out(op.peer, what, op.k + 1, op.pieces, timeout_s, state)
            if board.spin and now - start < 0.002:
                continue
            if now - start < 0.004:
                os.sched_yield()
            else:
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 250e-6 if now - start < 0.1 else 5e-3)
