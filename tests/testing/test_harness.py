"""The harness itself (tests/distributed.py): its ranks start warm, whatever a test module did to the forkserver."""

from __future__ import annotations

import gc
import multiprocessing as mp
import sys

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def _what_the_rank_started_with(rank: int, world_size: int) -> dict:
    return {"frozen": gc.get_freeze_count(),
            "imported": {m for m in ("torch._dynamo", "ringtrain.train.build") if m in sys.modules}}


def test_ranks_are_forked_from_a_server_that_imported_and_froze_what_they_need():
    """tests/rank_preload.py ran in the forkserver (its gc.freeze() is the only one), so no rank imports pytest,
    torch._dynamo or ringtrain's trainer again. A test module that sets its own preload list before the server
    starts (as tests/checkpoint/test_kill_during_save.py did: ["torch"], and every later rank of that test process
    imported the rest itself) does not change it: run_distributed sets the harness's list before each start."""
    mp.get_context("forkserver").set_forkserver_preload(["torch"])
    for started in run_distributed(_what_the_rank_started_with, 2):
        assert started["frozen"] > 100_000, started["frozen"]
        assert started["imported"] == {"torch._dynamo", "ringtrain.train.build"}
