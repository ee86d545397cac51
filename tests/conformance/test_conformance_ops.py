"""One of torch's own c10d tests per op, against ringtrain_shm at 2 ranks: the normal suite's share of the
conformance set (``make conformance`` runs all of it, ``tests/conformance/run.py``).

The selected tests run in one pytest process of ``torch_suite.py`` (the suite must be imported with its own
environment, which would leak into this process's other tests), each rank a process forked from it, a fresh process
group a test; each op's test here then reads its outcome."""

from __future__ import annotations

import pytest

from tests.conformance.run import run_suite

pytestmark = pytest.mark.job

SELECTED = {
    "registration": "test_ringtrain_process_groups_are_ringtrain_shm",  # ringtrain's: every group is ringtrain_shm's
    "gather": "test_gather_checks",
    "scatter": "test_scatter",
    "scatter_object_list": "test_scatter_object_list",
    "barrier": "test_barrier",
    "batch_isend_irecv": "test_batch_isend_irecv_gloo",
    "ddp_cpu": "test_DistributedDataParallelCPU",
    "send_recv": "test_send_recv",
    "isend": "test_isend",
    "all_reduce_max": "test_all_reduce_full_group_max",
    "reduce": "test_reduce_sum",
    "all_gather": "test_all_gather",
    "broadcast": "test_broadcast",
    "send_recv_profiled": "test_send_recv_autograd_profiler",
}
"""Each selected test passed on ringtrain_shm at 2 ranks (2026-12-07, ranks forked). torch tests all_to_all and
the tensor forms of all_gather / reduce_scatter on CPU for MPI only (its Gloo tests of them are CUDA's), so
``bench collectives --ops`` and the shmops property tests cover those."""


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    result = run_suite(2, [], timeout_s=600, tests=list(SELECTED.values()))
    by_test = {name: outcome for outcome, names in result["tests"].items() for name in names}
    by_test["_output"] = result["output_tail"]
    return by_test


@pytest.mark.timeout(900)
@pytest.mark.parametrize("op", list(SELECTED))
def test_torchs_c10d_test_passes_on_ringtrain_shm(op, outcomes):
    test = SELECTED[op]
    assert outcomes.get(test) == "passed", f"{test}: {outcomes.get(test, 'not run')}\n{outcomes['_output']}"


def test_only_the_selected_tests_ran(outcomes):
    """The run is the selected tests, not torch's whole suite (286 tests at 2 ranks, most of an hour)."""
    ran = set(outcomes) - {"_output"}
    assert ran == set(SELECTED.values()), f"ran {len(ran)} tests, not the {len(SELECTED)} selected: {sorted(ran)[:12]}"
