"""Bringing every member of a new generation to the same state, from the member that holds the newest.

A collective can complete on one rank and fail on another, so after a failure one survivor may have applied a
step the others have not; a joiner holds no state at all. Each member says where it stands, its *position*
(the step it applied, whether that step's epoch-end evaluation is done) and the sha256 of its model; the
first member at the newest position is the source, and any member whose (position, digest) differs receives
the source's state: the dict of stateful parts the trainer names (``Trainer.transfer_state``: model,
optimizer, sampler, train state, precision, micro-batch plan, progress).

Nothing received is unpickled before it is checked: positions and digests travel as JSON
(``comm/objects.py``); the state travels as ``torch.save`` bytes beside its sha256, each receiver compares the sha256
first and only then reads the bytes with ``torch.load(weights_only=True)`` (tensors and plain containers,
never an object), its pickle bounded before (``decode_limits``: nesting, size, memo slots). A copy that does
not match is refused and sent again (every rank learns it from one all-reduce), up to ``SEND_ATTEMPTS`` times.

    source = agree_on_state(position, digest, save=trainer.transfer_state, load=trainer.load_transfer_state)
"""

from __future__ import annotations

import hashlib
import io
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import all_gather_json, broadcast_bytes
from ringtrain.decode_limits import Refused, load_weights_only
from ringtrain.heal.membership import HealFailed
from ringtrain.testing import faults

__all__ = ["agree_on_state", "state_digest", "SEND_ATTEMPTS", "NO_STATE"]

SEND_ATTEMPTS = 3
"""Sends of the state to members whose copy did not match the sender's sha256."""
NO_STATE = (-1, 0)
"""The position of a member that holds no state yet (a joiner): never a source."""


def state_digest(module: torch.nn.Module) -> bytes:
    """sha256 of the module's parameters and buffers, by name."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def agree_on_state(position: tuple[int, int], digest: bytes, save: Callable[[], dict[str, Any]],
                   load: Callable[[dict[str, Any]], None]) -> int | None:
    """Every member at the newest (position, digest). Returns the rank the state came from (None: all agreed).
    ``position`` orders members (newest wins); ``save()`` the sender's state, ``load(state)`` a receiver's."""
    world_size = dist.get_world_size()
    everyone = _all_gather_positions(position, digest, world_size)
    newest = max(pos for pos, _ in everyone)
    if newest == NO_STATE:
        raise HealFailed("no remaining worker holds the training state (only joiners are left); resume with --resume")
    source = next(rank for rank, (pos, _) in enumerate(everyone) if pos == newest)
    if all(entry == everyone[source] for entry in everyone):
        return None
    data = b""
    for attempt in range(1, SEND_ATTEMPTS + 1):
        payload = None
        if dist.get_rank() == source:
            buffer = io.BytesIO()
            torch.save(save(), buffer)
            payload = buffer.getvalue()
        data, sent_sha = _broadcast_bytes(payload, source, attempt)
        intact = torch.tensor([float(hashlib.sha256(data).digest() == sent_sha)])
        dist.all_reduce(intact, op=dist.ReduceOp.MIN)  # everyone learns whether every copy arrived whole
        if intact.item():
            break
        if dist.get_rank() != source and hashlib.sha256(data).digest() != sent_sha:
            print(f"ringtrain: warning: the state received from rank {source} does not match its sha256 "
                  f"(attempt {attempt} of {SEND_ATTEMPTS}); refused, sent again", file=sys.stderr, flush=True)
    else:
        raise HealFailed(f"the state received from rank {source} did not match its sha256 in {SEND_ATTEMPTS} attempts; "
                         "resume with --resume")
    if dist.get_rank() != source and everyone[dist.get_rank()] != everyone[source]:
        load(_weights_only(data, source))
    return source


def _weights_only(data: bytes, source: int) -> dict[str, Any]:
    """The state a peer sent, read weights-only: tensors and plain containers, never an object."""
    try:
        state = load_weights_only(data, map_location=None)  # bounded first: decode_limits
    except Refused as err:
        raise PeerDataError(f"rank {source} sent a state that {err}; refused without unpickling it") from None
    except Exception as err:  # noqa: BLE001 - pickle.UnpicklingError for objects, others for junk
        raise PeerDataError(f"rank {source} sent a state that is not tensors and plain values "
                            f"({type(err).__name__}); refused") from None
    if not isinstance(state, dict):
        raise PeerDataError(f"rank {source} sent a {type(state).__name__} as the state; refused")
    return state


def check_agreed(position: tuple[int, int], digest: bytes) -> None:
    """After a transfer: every member holds the same (position, digest), or the heal fails in one line."""
    everyone = _all_gather_positions(position, digest, dist.get_world_size())
    if len(set(everyone)) > 1:
        steps = sorted({pos[0] for pos, _ in everyone})
        raise HealFailed(f"after healing the workers still hold different states (steps {steps}); resume with --resume")


def _all_gather_positions(position: tuple[int, int], digest: bytes, world_size: int) -> list[tuple[tuple[int, int], bytes]]:
    everyone = all_gather_json([*position, digest.hex()])
    return [((int(step), int(phase)), bytes.fromhex(hexdigest)) for step, phase, hexdigest in everyone]


def _broadcast_bytes(payload: bytes | None, source: int, attempt: int) -> tuple[bytes, bytes]:
    """``payload`` (the source's) on every rank, with the source's sha256 of it. The fault point
    ``heal.transfer`` may flip a byte on the wire (the sha256 is of what the source meant to send)."""
    sha = broadcast_bytes(hashlib.sha256(payload).digest() if payload is not None else None, src=source)
    wire = faults.through("heal.transfer", payload) if payload is not None else None
    return broadcast_bytes(wire, src=source), sha
