"""One of torch's own c10d tests per op, against ringtrain_shm at 2 ranks: the normal suite's share of the
conformance set (``make conformance`` runs all of it, ``tests/conformance/run.py``).

The selected tests run in one pytest process of ``torch_suite.py`` (the suite must be imported with its own
environment, which would leak into this process's other tests), each rank a process forked from it, a fresh process
group a test; each op's test here then reads its outcome."""

from __future__ import annotations

import os

import pytest

from tests.conformance.run import SUITE, run_suite

pytestmark = pytest.mark.skipif(
    os.environ.get("RINGTRAIN_CONFORMANCE_OPS") != "1",
    reason="torch's c10d tests per op: out of make test until they run within its budget (2026-12-07, after the "
           "shm ops landed: the seven selected tests did not finish in 20 minutes at 2 ranks, load 3-5); run "
           "RINGTRAIN_CONFORMANCE_OPS=1 pytest tests/conformance/test_conformance_ops.py, or make conformance")

SELECTED = {
    "registration": "test_ringtrain_process_groups_are_ringtrain_shm",  # ringtrain's: every group is ringtrain_shm's
    "gather": "test_gather_checks",
    "scatter": "test_scatter",
    "scatter_object_list": "test_scatter_object_list",
    "barrier": "test_barrier",
    "batch_isend_irecv": "test_batch_isend_irecv_gloo",
    "ddp_cpu": "test_DistributedDataParallelCPU",
}
TO_ADD = ("test_all_reduce_full_group_max", "test_reduce_sum", "test_all_gather", "test_broadcast", "test_send_recv",
          "test_isend")
"""Each selected test passed on ringtrain_shm in a conformance run (2026-12-07); TO_ADD are the other ops' tests,
to move into SELECTED once a run has shown them passing (not run yet: the machine was at load 24-48)."""
"""op -> torch's test of it (``DistributedTest._DistTestBase``), cheap ones: a few seconds each on a quiet machine.
torch tests all_to_all and the tensor forms of all_gather / reduce_scatter on CPU for MPI only (its Gloo tests
of them are CUDA's), so ``bench collectives --ops`` and the shmops property tests cover those. Not here yet:
``test_all_reduce_sum`` (the one op ringtrain_shm runs on shared memory today) timed out at torch's 300 s at 2
ranks in the first conformance run, on the development machine at load 24-48: ``make conformance`` reports it
until it passes."""


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    result = run_suite(2, [f"{SUITE}::TestRingtrainShm::{name}" for name in SELECTED.values()], timeout_s=1500)
    by_test = {name: outcome for outcome, names in result["tests"].items() for name in names}
    by_test["_output"] = result["output_tail"]
    return by_test


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("op", list(SELECTED))
def test_torchs_c10d_test_passes_on_ringtrain_shm(op, outcomes):
    test = SELECTED[op]
    assert outcomes.get(test) == "passed", f"{test}: {outcomes.get(test, 'not run')}\n{outcomes['_output']}"
