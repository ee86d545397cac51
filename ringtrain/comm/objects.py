"""Collectives that move Python values between ranks without pickle: bytes on the wire, parsers that build
plain values on arrival.

``torch.distributed``'s ``all_gather_object`` / ``gather_object`` / ``broadcast_object_list`` pickle each
value and ``pickle.loads`` whatever every peer sent, so one process on the job's sockets (a rogue or
confused peer, a stale worker of another job on a reused port) runs code in every process that receives.
These move bytes instead and decode them as JSON (``*_json``), as fixed-width integers (``gather_ints``), as
a weights-only ``torch.save`` (``gather_weights_only``: tensors and plain containers), or leave the decoding
to the caller (``*_bytes``: e.g. a ``torch.save`` read back with ``torch.load(weights_only=True)`` after its
sha256 is checked). Anything else a peer sends is refused with
``PeerDataError``, one line naming the rank. Before decoding, the bytes are bounded (``decode_limits``): JSON
nesting (``json.loads`` would raise RecursionError at a few thousand ``[``), and a torch.save's pickle
(nesting, size, memo slots: a hostile one crashes the receiving process with SIGSEGV before any exception).

The wire is torch's own for these collectives (one int64 length per rank, then the bytes as uint8, padded
to the longest), on the device torch picks for them (CPU under Gloo, the current GPU under NCCL): a rank
using these and one using torch's object collectives exchange the same tensors.

    >>> all_gather_json({"step": 3, "host": "a"})          # every rank: [{'step': 3, 'host': 'a'}, ...]
    >>> gather_ints([4, 9, 1], dst=0)                      # rank 0: [[4, 9, 1], [...], ...]; others: None
    >>> broadcast_bytes(payload if rank == src else None, src=src)
"""

from __future__ import annotations

import io
import json
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.decode_limits import Refused, check_json, load_weights_only

__all__ = ["all_gather_bytes", "gather_bytes", "broadcast_bytes", "all_gather_json", "gather_json", "gather_ints",
           "gather_weights_only", "broadcast_weights_only", "decode_json", "every_rank"]

_INT = "q"  # int64, little-endian on the wire
_LITTLE = sys.byteorder == "little"


# --- bytes ---------------------------------------------------------------------------------------------
def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``data``, in rank order (of ``group``)."""
    device = _device(group)
    size = dist.get_world_size(group)
    sizes = torch.zeros(size, dtype=torch.long, device=device)
    dist.all_gather(list(sizes.split(1)), torch.tensor([len(data)], dtype=torch.long, device=device), group=group)
    lengths = _lengths(sizes)
    longest = max(1, *lengths)  # never an empty tensor on the wire
    out = torch.empty(longest * size, dtype=torch.uint8, device=device)
    dist.all_gather(list(out.split(longest)), _padded(data, longest, device), group=group)
    flat = out.cpu().numpy().tobytes()
    return [flat[i * longest: i * longest + n] for i, n in enumerate(lengths)]


def gather_bytes(data: bytes, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[bytes] | None:
    """Every rank's ``data`` in rank order on ``dst`` (a global rank, as in torch); None on the others."""
    device = _device(group)
    size = dist.get_world_size(group)
    sizes = torch.zeros(size, dtype=torch.long, device=device)
    dist.all_gather(list(sizes.split(1)), torch.tensor([len(data)], dtype=torch.long, device=device), group=group)
    lengths = _lengths(sizes)
    longest = max(1, *lengths)
    out = torch.empty(longest * size, dtype=torch.uint8, device=device) if dist.get_rank() == dst else None
    dist.gather(_padded(data, longest, device), gather_list=None if out is None else list(out.split(longest)), dst=dst,
                group=group)
    if out is None:
        return None
    flat = out.cpu().numpy().tobytes()
    return [flat[i * longest: i * longest + n] for i, n in enumerate(lengths)]


def broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup | None = None) -> bytes:
    """``src``'s ``data`` (a global rank, as in torch) on every rank; the others pass None."""
    device = _device(group)
    mine = dist.get_rank() == src
    if mine and data is None:
        raise ValueError("broadcast_bytes: the source rank must pass its bytes")
    length = torch.tensor([len(data) if mine else 0], dtype=torch.long, device=device)
    dist.broadcast(length, src=src, group=group)
    (n,) = _lengths(length)
    buffer = _padded(data, max(1, n), device) if mine else torch.empty(max(1, n), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return data if mine else buffer.cpu().numpy().tobytes()[:n]


# --- values --------------------------------------------------------------------------------------------
def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (JSON: None, bools, numbers, strings, lists, dicts with string keys; tuples
    arrive as lists), in rank order."""
    return [decode_json(data, _global(group, r)) for r, data in enumerate(all_gather_bytes(_encode(value), group))]


def every_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (every rank gets the same answer; a collective where
    the group has more than one rank, none without a group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return bool(flag)
    return all(all_gather_json(bool(flag), group))


def gather_json(value: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``value`` (JSON, as ``all_gather_json``) in rank order on ``dst``; None on the others."""
    gathered = gather_bytes(_encode(value), dst, group)
    return None if gathered is None else [decode_json(data, _global(group, r)) for r, data in enumerate(gathered)]


def gather_ints(values: Sequence[int], dst: int = 0, group: dist.ProcessGroup | None = None) -> list[list[int]] | None:
    """Every rank's integers (int64) in rank order on ``dst``; None on the others. As fast as pickle for long
    lists (a copy into an int64 array each way), where JSON takes about four times as long."""
    gathered = gather_bytes(_ints_bytes(values), dst, group)
    return None if gathered is None else [_bytes_ints(data, _global(group, r)) for r, data in enumerate(gathered)]


def gather_weights_only(value: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``value`` in rank order on ``dst`` (None on the others), for values with tensors: sent as
    ``torch.save`` writes it, read back as a checkpoint is, with ``torch.load(weights_only=True)`` (tensors,
    numbers, strings, containers; never a pickled object)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    gathered = gather_bytes(buffer.getvalue(), dst, group)
    return None if gathered is None else [_weights_only(data, _global(group, r)) for r, data in enumerate(gathered)]


def broadcast_weights_only(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """``src``'s ``value`` (a global rank; the others pass None) on every rank, for values with tensors: sent
    and read back as ``gather_weights_only``'s."""
    data = None
    if dist.get_rank() == src:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        data = buffer.getvalue()
    received = broadcast_bytes(data, src, group)
    return value if dist.get_rank() == src else _weights_only(received, src)


def decode_json(data: bytes, rank: int) -> Any:
    """``rank``'s bytes as JSON, or PeerDataError naming the rank (never anything but plain values)."""
    try:
        check_json(data)
    except Refused as err:
        raise PeerDataError(f"rank {rank} sent {len(data)} bytes of JSON that {err}; refused without decoding",
                            peer=rank) from None
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
        raise PeerDataError(f"rank {rank} sent {len(data)} bytes that are not JSON ({data[:16]!r}...): not a ringtrain "
                            "peer, or one running other code; refused without decoding", peer=rank) from None


# --- helpers -------------------------------------------------------------------------------------------
def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode("utf-8")


def _weights_only(data: bytes, rank: int) -> Any:
    try:
        return load_weights_only(data)  # bounded (decode_limits), then torch.load(weights_only=True)
    except Refused as err:
        raise PeerDataError(f"rank {rank} sent {len(data)} bytes that are not a weights-only torch.save within bounds "
                            f"(it {err}); refused without unpickling", peer=rank) from None
    except Exception as err:  # noqa: BLE001 - UnpicklingError for objects, others for bytes that are not torch.save's
        raise PeerDataError(f"rank {rank} sent {len(data)} bytes that are not a weights-only torch.save "
                            f"({type(err).__name__}); refused without unpickling an object", peer=rank) from None


def _ints_bytes(values: Sequence[int]) -> bytes:
    packed = array(_INT, values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _bytes_ints(data: bytes, rank: int) -> list[int]:
    if len(data) % 8:
        raise PeerDataError(f"rank {rank} sent {len(data)} bytes, not a whole number of int64 values; refused", peer=rank)
    packed = array(_INT)
    packed.frombytes(data)
    if not _LITTLE:
        packed.byteswap()
    return packed.tolist()


def _lengths(sizes: torch.Tensor) -> list[int]:
    lengths = sizes.cpu().tolist()
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise PeerDataError(f"rank {bad} announced a length of {lengths[bad]} bytes; refused", peer=bad)
    return lengths


def _padded(data: bytes, length: int, device: Any) -> torch.Tensor:
    tensor = torch.zeros(length, dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor.to(device)


def _device(group: dist.ProcessGroup | None) -> str:
    # torch's choice for its object collectives (the same wire as theirs): CPU under Gloo, the GPU under NCCL.
    return dist.distributed_c10d._get_object_coll_device(group)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """A rank of ``group`` as a user reads it in logs (a rank of the default group)."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
