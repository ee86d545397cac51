"""A peer's ``[pid, token]`` becomes a path in /dev/shm only once checked (issue 39, row 7): a host's leader
announcing a token with ``/`` and ``..`` in it (which would have had the victim map, then unlink, a file of the
attacker's choosing) is refused in one line naming it, by ``ShmGroup.share_segment`` on a real Gloo group."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import all_gather_json
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def hostile_leader(rank: int, world_size: int, token: str) -> str:
    from ringtrain.comm.groups import host_id
    from ringtrain.comm.shm_group import ShmGroup

    os.environ["RINGTRAIN_SHM_NATIVE"] = "0"
    if rank == 0:  # the host's first rank: the one whose announcement names the segment
        all_gather_json([host_id(), [0], False])  # the host exchange, as ShmGroup.build sends it
        all_gather_json([os.getpid(), token])     # the segment's name: a path out of /dev/shm
        return "sent"
    try:
        ShmGroup.build(dist.group.WORLD)
    except PeerDataError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - what today's code did instead (it went on to open the path)
        return f"{type(err).__name__}: {err}"
    return "accepted"


def test_a_leaders_token_that_leaves_dev_shm_is_refused_in_one_line(tmp_path):
    token = f"x/../../..{tmp_path}/target"
    _, message = run_distributed(hostile_leader, 2, token, collective_timeout_s=5)
    assert message.startswith("shm set-up failed: rank 0 announced shm segment ["), message
    assert message.endswith("not [pid, 12 hex digits]: not a ringtrain peer; refused") and "\n" not in message
