"""The pipeline's gather of every stage's state (parallel/pipeline.py ``_all_gather_tensors``) moves no pickle:
the structure as JSON and the tensors as raw bytes (comm/objects.py), as architecture.md asks of every
exchange; a peer's entry its bytes do not hold is refused in one line naming the rank (issue 39, row 10)."""

from __future__ import annotations

import re

import pytest
import torch

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import all_gather_bytes, all_gather_json
from tests.conftest import REPO
from tests.distributed import run_distributed

OBJECT_COLLECTIVE = re.compile(r"\.(all_gather_object|gather_object|broadcast_object_list|scatter_object_list)\(")


@pytest.mark.unit
def test_no_object_collective_is_called_anywhere_in_ringtrain():
    """Before: parallel/pipeline.py gathered state dicts with dist.all_gather_object (pickle over the wire)."""
    calls = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "ringtrain").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if OBJECT_COLLECTIVE.search(line)]
    assert calls == [], f"object collectives (they unpickle what peers send): {calls}"


def _state(rank: int) -> dict:
    return {
        f"blocks.{rank}.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank,
        f"blocks.{rank}.half": torch.full((3,), 1.5 + rank, dtype=torch.bfloat16),
        f"blocks.{rank}.mask": torch.tensor([True, False, bool(rank)]),
        f"blocks.{rank}.count": torch.tensor(7 + rank, dtype=torch.int64),  # 0-dim, as an optimizer's step
        f"blocks.{rank}.empty": torch.zeros(0, 4),
        f"blocks.{rank}.moments": {"step": 3.0 + rank, "exp_avg": torch.ones(2, 2, dtype=torch.float64) * rank,
                                   "note": None},
        f"blocks.{rank}.strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }


def _gather(rank: int, world_size: int) -> list:
    import torch.distributed as dist

    from ringtrain.parallel.pipeline_wire import _all_gather_tensors

    return _all_gather_tensors(_state(rank), dist.group.WORLD)


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return got == want


@pytest.mark.ranks
def test_every_ranks_tensors_arrive_whole_in_rank_order():
    out = run_distributed(_gather, 2)
    for rank in range(2):
        assert len(out[rank]) == 2 and all(_same(out[rank][r], _state(r)) for r in range(2))


BAD_ENTRIES = [
    ["float32", [4], 0, 10_000],            # more bytes than were sent
    ["float32", [4], 8, 16],                # past the end of the 16 bytes
    ["float32", [5], 0, 16],                # a shape its length does not hold
    ["object", [1], 0, 4],                  # no such dtype here
    ["float32')__import__('os')", [1], 0, 4],
    ["float32", [-4], 0, 16],
    ["float32", "4", 0, 16],
    ["float32", [4], -8, 16],
    ["float32", [4], 0],
]


def _hostile(rank: int, world_size: int, entry: list) -> str | None:
    import torch.distributed as dist

    from ringtrain.parallel.pipeline_wire import _all_gather_tensors

    if rank == 1:  # a peer on the pipeline's wire, sending what the gather carries but lying about its bytes
        all_gather_json({"blocks.1.weight": {"\u0000tensor": entry}})
        all_gather_bytes(torch.ones(4).numpy().tobytes())
        return None
    try:
        _all_gather_tensors(_state(0), dist.group.WORLD)
    except PeerDataError as err:
        return str(err)
    return "accepted"


@pytest.mark.ranks
@pytest.mark.parametrize("entry", BAD_ENTRIES, ids=[str(i) for i in range(len(BAD_ENTRIES))])
def test_a_tensor_entry_its_bytes_do_not_hold_is_refused_in_one_line(entry):
    message = run_distributed(_hostile, 2, entry)[0]
    assert message.startswith("rank 1 sent a tensor entry ") and message.endswith("do not hold; refused"), message
    assert "\n" not in message
