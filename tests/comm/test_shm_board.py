"""The shm flag board's abort line when two ranks fail at once (issue 9, item 6): every rank must read one
report, culprit and reason from the same rank, never a mix of two."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.comm.shm_board import _MISMATCH, _TIMEOUT
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

ROUNDS = 1500
# What each rank reports when both fail together: rank 0 saw rank 1 time out, rank 1 saw rank 0 call another
# collective. Whichever lands, the error every rank raises must be one of these two, whole.
POSTS = {0: (1, _TIMEOUT), 1: (0, _MISMATCH)}
REPORTS = {("PeerTimeoutError", 1, "seen by rank 0"), ("MismatchError", 0, "seen by rank 1")}


def _report(err: Exception) -> tuple:
    reporter = str(err).split("(seen by rank ")[1].split(")")[0]
    return (type(err).__name__, err.peer, f"seen by rank {reporter}")


def race_to_abort(rank: int, world_size: int) -> list[tuple]:
    board = shm.init_shm().board
    seen = []
    for round_index in range(ROUNDS):
        count = board.arrive()
        early = None
        try:
            board.wait_all(count, "test barrier", 1, 1, 10.0)  # spin: both leave within a microsecond or so
        except comm.CollectiveError as err:
            # The peer left first and posted while this rank, descheduled (another test's processes on the
            # core), had not yet seen its arrival: this rank read the peer's report, and posting below keeps it.
            early = _report(err)
        culprit, reason = POSTS[rank]
        board._post_abort(culprit, reason, round_index + 1)
        dist.barrier()
        try:
            board.arrive()  # refuses, raising what the abort line says
            seen.append(("no error", None, ""))
        except comm.CollectiveError as err:
            report = _report(err)
            # A report read early must be the one the line still holds: one whole report per round.
            seen.append(report if early in (None, report) else ("changed", early, report))
        dist.barrier()
        if rank == 0:  # clear the line for the next round (the test's doing; a real group stays aborted)
            for word in range(8):
                board.flags[board.abort_line + word] = 0
        dist.barrier()
    return seen


def test_two_ranks_aborting_together_leave_one_whole_report():
    per_rank = run_distributed(race_to_abort, 2, timeout_s=120)
    mixed = [(i, per_rank[0][i]) for i in range(ROUNDS) if per_rank[0][i] not in REPORTS]
    differ = [i for i in range(ROUNDS) if per_rank[0][i] != per_rank[1][i]]
    assert not mixed, f"{len(mixed)} of {ROUNDS} rounds read a report no rank wrote, e.g. {mixed[0]}"
    assert not differ, f"{len(differ)} of {ROUNDS} rounds: the two ranks read different reports"


def spin_decision(rank: int, world_size: int, pin: bool) -> bool:
    import os

    if pin:
        os.sched_setaffinity(0, {0})  # both ranks on one core, as a CPU set of one or a shared pin gives
    return shm.init_shm().board.spin


def test_ranks_that_share_a_core_do_not_spin():
    # Before, the decision counted os.cpu_count() (2 here) and both ranks spun on one core, each burning
    # its time slice while the other, which it waits for, could not run.
    assert run_distributed(spin_decision, 2, True) == [False, False]
