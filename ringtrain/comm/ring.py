"""Ring all-reduce: reduce-scatter, then all-gather, over non-blocking point-to-point messages.

The tensor is cut into one shard per rank (``shards.shard_bounds``). In ``n - 1`` reduce-scatter steps
every rank sends one shard to its right neighbour and adds the shard arriving from its left one; after
them rank ``r`` holds shard ``r`` summed over all ranks. In ``n - 1`` all-gather steps the finished shards
travel once more around the ring. Each rank sends ``2 (n - 1) / n`` of the tensor in all, which no
all-reduce can beat (Patarasuk & Yuan, 2009), and every finished shard was summed by exactly one rank and
then copied, so all ranks end with bit-identical values.

Sends and receives of a step are posted together (``batch_isend_irecv``) before either is waited on, so
no world size deadlocks, and NCCL gets them as one group. Works on any backend with point-to-point
support (Gloo, NCCL)::

    >>> from ringtrain.comm import ring
    >>> ring.all_reduce(flat, group)          # flat: a contiguous 1-D tensor, summed in place
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from ringtrain.comm.errors import CollectiveError, PeerDiedError, PeerTimeoutError
from ringtrain.comm.groups import global_rank, group_rank, group_size
from ringtrain.comm.scratch import scratch
from ringtrain.comm.shards import tensor_shards
from ringtrain.testing import faults

__all__ = [
    "all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_order", "all_gather_order", "RingPeers", "MAX_MESSAGE_BYTES",
]

MAX_MESSAGE_BYTES = 4 << 20
"""Largest single point-to-point message; bigger sends are split (see ``RingPeers.post``)."""
_PIECES_PER_TAG = 1 << 10  # message tags: tag * _PIECES_PER_TAG + piece, unique within a collective


class RingPeers:
    """This rank's place in the ring of ``group``: neighbours, step counting, failures named by rank."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, what: str, members: list[int] | None = None):
        """``members``: the group ranks that form the ring, in ring order (default: the whole group).

        A ring over a subset (host leaders, in the hierarchical shm all-reduce) sends point-to-point
        inside ``group`` and needs no group of its own.
        """
        self.group = group
        members = list(range(group_size(group))) if members is None else members
        me = members.index(group_rank(group))
        self.size = len(members)
        self.rank = me
        """This rank's position in the ring (its group rank when the ring is the whole group)."""
        self.right = members[(me + 1) % self.size]
        self.left = members[(me - 1) % self.size]
        self.me = members[me]
        self.timeout = timedelta(seconds=timeout_s)
        self.what = what
        """The operation, for error messages: 'ring all_reduce', 'ring_chunked reduce_scatter', ..."""

    def post(self, send: torch.Tensor | None, recv: torch.Tensor | None, tag: int = 0) -> tuple[list, list]:
        """Post a send to the right and a receive from the left together; return (send works, receive works).

        A large tensor goes as several messages of at most ``MAX_MESSAGE_BYTES``: Gloo's TCP pair moves one
        huge message in each direction at once at about a third of the speed of the same bytes in 4 MB
        messages (measured on loopback). Empty tensors are not sent; both sides compute the same shard
        sizes, so they skip the same messages.
        """
        ops, kinds = [], []
        # Receives first: in a ring of two (host leaders of two hosts) both directions share one Gloo pair, and
        # with sends posted first a 16 MB all-reduce between two test hosts over a 1 Gbit/s link took 2x as
        # long as Gloo's own (0.51x); receives first, 0.94x (docs/benchmarks.md, "Across hosts").
        for kind, tensor, peer in (("recv", recv, self.left), ("send", send, self.right)):
            if tensor is None or not tensor.numel():
                continue
            step = max(1, MAX_MESSAGE_BYTES // tensor.element_size())
            for piece, lo in enumerate(range(0, tensor.numel(), step)):
                op = dist.isend if kind == "send" else dist.irecv
                message_tag = tag * _PIECES_PER_TAG + piece
                ops.append(dist.P2POp(op, tensor[lo : lo + step], group=self.group, tag=message_tag, group_peer=peer))
                kinds.append(kind)
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # NCCL coalesces a group into one work: waiting on it waits for all
            works = [works[-1]] * len(ops)
        return ([w for w, k in zip(works, kinds) if k == "send"], [w for w, k in zip(works, kinds) if k == "recv"])

    def wait(self, work: dist.Work, peer: int, step: int, steps: int, receiving: bool | None = None) -> None:
        """Wait for one message; a failure names the peer, the step and what went wrong. ``receiving``:
        whether the message comes from ``peer`` (default: from the left neighbour, not to the right one)."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:  # DistBackendError and Gloo's plain RuntimeErrors
            raise self.failure(err, peer, step, steps, receiving) from err

    def failure(self, err: BaseException, peer: int, step: int, steps: int, receiving: bool | None = None) -> CollectiveError:
        who = global_rank(self.group, peer)
        me = global_rank(self.group, self.me)
        receiving = peer != self.right if receiving is None else receiving
        direction = "receiving from" if receiving else "sending to"
        text = _first_sentence(str(err))
        if "timed out" in text.lower() or "timeout" in text.lower():
            return PeerTimeoutError(
                f"{self.what}: rank {who} did not answer within {self.timeout.total_seconds():g} s while rank {me} "
                f"was {direction} it at step {step} of {steps}",
                peer=who,
            )
        return PeerDiedError(
            f"{self.what}: lost rank {who} while rank {me} was {direction} it at step {step} of {steps} ({text})",
            peer=who,
        )

    def run_step(self, send: torch.Tensor, recv: torch.Tensor, step: int, steps: int,
                 meanwhile: Callable[[], None] | None = None) -> None:
        """One step: post the send and the receive, run ``meanwhile`` (if any) while they travel, wait."""
        send_works, recv_works = self.post(send, recv, tag=step)
        if meanwhile is not None:
            meanwhile()
        for work in recv_works:
            self.wait(work, self.left, step, steps)
        for work in send_works:
            self.wait(work, self.right, step, steps)
        faults.point("ring.step")


def _first_sentence(message: str) -> str:
    """Gloo's message without its source location and advice: 'Read error [127.0.0.1]:3478: Connection reset'."""
    text = " ".join(message.split())
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return re.split(r"\.\s", text, maxsplit=1)[0][:160]


def reduce_scatter(
    flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, what: str = "ring reduce_scatter", members: list[int] | None = None,
    meanwhile: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Sum ``flat`` over the group so that this rank's shard holds the total; return that shard (a view).

    The other shards are left holding partial sums. ``members``: see ``RingPeers``. ``meanwhile(step)``
    runs while step ``step`` (0-based) is on the wire. It must not write the shard being sent; it may still
    change the one being received (``reduce_scatter_order(...)[step + 1]``), which the received partial sums
    are added to only after it returns: the hierarchical all-reduce sums that shard inside its host then.
    """
    ring = RingPeers(group, timeout_s, what, members)
    n, r = ring.size, ring.rank
    bounds = tensor_shards(flat, n)
    longest = max(hi - lo for lo, hi in bounds)
    incoming = scratch(longest, flat.dtype, flat.device)
    steps = 2 * (n - 1) if "all_reduce" in what else n - 1
    for step in range(n - 1):
        send_lo, send_hi = bounds[(r - step - 1) % n]
        recv_lo, recv_hi = bounds[(r - step - 2) % n]
        tmp = incoming[: recv_hi - recv_lo]
        ring.run_step(flat[send_lo:send_hi], tmp, step + 1, steps,
                      None if meanwhile is None else partial(meanwhile, step))
        flat[recv_lo:recv_hi].add_(tmp)
    lo, hi = bounds[r]
    return flat[lo:hi]


def all_gather(
    flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, what: str = "ring all_gather", members: list[int] | None = None,
    meanwhile: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Given this rank's shard of ``flat`` (``tensor_shards``), fill in every other rank's shard in place.

    ``meanwhile(step)`` runs while step ``step`` (0-based) is on the wire; it may read the finished shards
    (``all_gather_order``: at step s, the first s + 1 of them) but write none."""
    ring = RingPeers(group, timeout_s, what, members)
    n, r = ring.size, ring.rank
    bounds = tensor_shards(flat, n)
    offset, steps = (n - 1, 2 * (n - 1)) if "all_reduce" in what else (0, n - 1)
    for step in range(n - 1):
        send_lo, send_hi = bounds[(r - step) % n]
        recv_lo, recv_hi = bounds[(r - step - 1) % n]
        ring.run_step(flat[send_lo:send_hi], flat[recv_lo:recv_hi], offset + step + 1, steps,
                      None if meanwhile is None else partial(meanwhile, step))
    return flat


def reduce_scatter_order(position: int, size: int) -> list[int]:
    """The shards of ``reduce_scatter`` at ring ``position`` of ``size``, in the order it needs them summed:
    the first is sent at step 0, the one after it received (and added) at step 0, and so on."""
    return [(position - 1 - k) % size for k in range(size)]


def all_gather_order(position: int, size: int) -> list[int]:
    """The shards of ``all_gather`` at ring ``position`` of ``size`` in the order they become final here:
    its own first, then the one received at step 0, and so on."""
    return [(position - k) % size for k in range(size)]


def all_reduce(
    flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, members: list[int] | None = None, what: str = "ring all_reduce"
) -> torch.Tensor:
    """Sum the contiguous 1-D ``flat`` over ``group`` (or its ``members``) in place: reduce-scatter, then all-gather."""
    reduce_scatter(flat, group, timeout_s, what=what, members=members)
    return all_gather(flat, group, timeout_s, what=what, members=members)
