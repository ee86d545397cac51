"""What ranks send each other is never unpickled (comm/objects.py): every exchange of Python values in
ringtrain's own code moves bytes and decodes them as JSON, int64s or a weights-only torch.save.

Each call site is driven for real on rank 0 while rank 1 plays a hostile peer: it sends, on the same wire as
torch's object collectives (a length, then the bytes), a pickle whose ``__reduce__`` would create a marker
file. The victim must refuse it in one line naming rank 1, and the marker must not exist. Swapping any of
these call sites back to ``dist.all_gather_object`` / ``gather_object`` makes the victim unpickle the
payload (the marker appears): the test fails.
"""

from __future__ import annotations

import os
import pickle
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import (
    all_gather_bytes,
    all_gather_json,
    broadcast_bytes,
    gather_bytes,
    gather_ints,
    gather_json,
    gather_weights_only,
)
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


class _Payload:
    """Unpickled, it runs ``touch MARKER``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _evil(marker: str) -> bytes:
    # A length that is no whole number of int64s either (pickle ignores what follows its STOP).
    data = pickle.dumps(_Payload(marker))
    return data + b"\0" * (1 if len(data) % 8 == 0 else 0)


# --- the primitives, between honest ranks ------------------------------------------------------------
def exchange(rank: int, world_size: int) -> dict:
    ids = list(range(rank * 1000, rank * 1000 + rank * 7))  # rank 0 sends no ids at all
    value = {"rank": rank, "note": "é" * rank, "none": None, "nested": [rank, [1.5, True]]}
    return {
        "json": all_gather_json(value),
        "gather_json": gather_json(value, dst=1),
        "ints": gather_ints(ids, dst=0),
        "big": gather_ints([2**62 + rank, -(2**63)], dst=0),
        "bytes": all_gather_bytes(bytes([rank]) * rank),
        "gather_bytes": gather_bytes(b"x" * (3 - rank), dst=2),
        "broadcast": broadcast_bytes(b"state of rank 2" if rank == 2 else None, src=2),
        "empty": broadcast_bytes(b"" if rank == 0 else None, src=0),
        "weights": gather_weights_only({"t": torch.full((rank + 1,), float(rank)), "k": "v"}, dst=0),
    }


def test_the_safe_collectives_carry_every_rank_s_value_in_rank_order():
    out = run_distributed(exchange, 3)
    values = [{"rank": r, "note": "é" * r, "none": None, "nested": [r, [1.5, True]]} for r in range(3)]
    for rank in range(3):
        assert out[rank]["json"] == values
        assert out[rank]["gather_json"] == (values if rank == 1 else None)
        assert out[rank]["bytes"] == [b"", b"\x01", b"\x02\x02"]
        assert out[rank]["gather_bytes"] == ([b"xxx", b"xx", b"x"] if rank == 2 else None)
        assert out[rank]["broadcast"] == b"state of rank 2"
        assert out[rank]["empty"] == b""
    assert out[0]["ints"] == [[], list(range(1000, 1007)), list(range(2000, 2014))]
    assert out[0]["big"] == [[2**62 + r, -(2**63)] for r in range(3)]
    assert out[1]["ints"] is None and out[1]["weights"] is None
    weights = out[0]["weights"]
    assert [w["k"] for w in weights] == ["v"] * 3
    assert all(torch.equal(w["t"], torch.full((r + 1,), float(r))) for r, w in enumerate(weights))


# --- each call site against a hostile rank 1 -----------------------------------------------------------
def _victim_steps(rank: int) -> None:
    from ringtrain.train.resume import check_same_choice

    check_same_choice(40)


def _victim_replicas(rank: int) -> None:
    from ringtrain.train.guards import check_replicas

    check_replicas({"w": torch.ones(3)}, step=5)


def _victim_oom_messages(rank: int) -> None:
    from ringtrain.config import TrainConfig
    from ringtrain.train.batch_size import MicroBatcher

    MicroBatcher(TrainConfig(), None, rank, 2, torch.device("cpu")).failed_ranks("out of memory")


def _victim_rank_states(rank: int) -> None:
    from ringtrain.train.comm_state import gather_rank_states

    gather_rank_states(SimpleNamespace(has_rank_state=True, state_dict=lambda: {"error": torch.zeros(2)}))


def _victim_ledger(rank: int) -> None:
    from ringtrain.data.ledger import Ledger

    Ledger(Path(os.environ["HOSTILE_TMP"]) / "ledger.jsonl", 100, is_writer=rank == 0).record(1, 0, [3, 4], False)


def _victim_placement(rank: int) -> None:
    from ringtrain.host.pinning import host_placement

    host_placement(None)


def _victim_shm(rank: int) -> None:
    from ringtrain.comm.shm_group import ShmGroup

    os.environ["RINGTRAIN_SHM_NATIVE"] = "0"  # the exchange comes before any use of the native path
    ShmGroup.build(dist.group.WORLD)


def _victim_heal_transfer(rank: int) -> None:
    from ringtrain.heal.transfer import agree_on_state

    agree_on_state((3, 1), bytes(32), save=dict, load=lambda state: None)


def _attack_heal_transfer(evil: bytes) -> None:
    """A peer that claims the newest state and sends a pickle as its bytes, with the right sha256."""
    import hashlib

    all_gather_json([5, 1, "00" * 32])
    broadcast_bytes(hashlib.sha256(evil).digest(), src=1)
    broadcast_bytes(evil, src=1)
    dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MIN)  # "every copy arrived whole": the sha256 matches


def _attack_all_gather(evil: bytes) -> None:
    all_gather_bytes(evil)


def _attack_gather(evil: bytes) -> None:
    gather_bytes(evil, dst=0)


def _attack_after_oom_flags(evil: bytes) -> None:
    flags = torch.tensor([0, 1], dtype=torch.int32)  # "rank 1 ran out of memory": the messages are gathered
    dist.all_reduce(flags)
    all_gather_bytes(evil)


SITES = {
    "resume.check_same_choice": (_victim_steps, _attack_all_gather),
    "guards.check_replicas": (_victim_replicas, _attack_all_gather),
    "batch_size.failed_ranks": (_victim_oom_messages, _attack_after_oom_flags),
    "comm_state.gather_rank_states": (_victim_rank_states, _attack_gather),
    "ledger.record": (_victim_ledger, _attack_gather),
    "pinning.host_placement": (_victim_placement, _attack_all_gather),
    "shm_group.build": (_victim_shm, _attack_all_gather),
    "heal.transfer.agree_on_state": (_victim_heal_transfer, _attack_heal_transfer),
}


def hostile_rank_one(rank: int, world_size: int, site: str, marker: str, tmp: str) -> str:
    victim, attack = SITES[site]
    os.environ["HOSTILE_TMP"] = tmp
    if rank == 1:
        attack(_evil(marker))
        return "sent"
    try:
        victim(rank)
    except PeerDataError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - reported after the marker is checked: what ran comes first
        return f"{type(err).__name__}: {err}"
    return "accepted"


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_pickle_from_a_peer_is_refused_at_every_call_site_and_runs_nothing(tmp_path, site):
    marker = tmp_path / "pwned"
    message, _ = run_distributed(hostile_rank_one, 2, site, str(marker), str(tmp_path))
    assert not marker.exists(), f"{site}: the peer's pickle ran"
    assert message.startswith("rank 1 sent ") and "\n" not in message, message
    assert "refused" in message, message


def refuse_a_negative_length(rank: int, world_size: int) -> str:
    if rank == 1:  # announces -5 bytes: the victim must not allocate or read anything
        dist.all_gather([torch.zeros(1, dtype=torch.long) for _ in range(2)], torch.tensor([-5]))
        return "sent"
    try:
        all_gather_json("hello")
    except PeerDataError as err:
        return str(err)
    return "accepted"


def test_a_peer_announcing_a_negative_length_is_named():
    message, _ = run_distributed(refuse_a_negative_length, 2)
    assert message == "rank 1 announced a length of -5 bytes; refused", message
