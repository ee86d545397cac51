"""One of torch's own c10d tests per op, against ringtrain_shm at 2 ranks: the normal suite's share of the
conformance set (``make conformance`` runs all of it, ``tests/conformance/run.py``).

The selected tests run in one pytest process of ``torch_suite.py`` (the suite must be imported with its own
environment, which would leak into this process's other tests), each rank a spawned process, a fresh process
group a test; each op's test here then reads its outcome."""

from __future__ import annotations

import pytest

from tests.conformance.run import SUITE, run_suite

SELECTED = {
    "registration": "test_ringtrain_process_groups_are_ringtrain_shm",  # ringtrain's: every group is ringtrain_shm's
    "all_reduce": "test_all_reduce_sum",
    "all_reduce_subgroup_max": "test_all_reduce_full_group_max",
    "reduce": "test_reduce_sum",
    "all_gather": "test_all_gather",
    "gather": "test_gather",
    "scatter": "test_scatter",
    "broadcast": "test_broadcast",
    "barrier": "test_barrier",
    "send_recv": "test_send_recv",
    "isend_irecv": "test_isend",
    "batch_isend_irecv": "test_batch_isend_irecv_gloo",
    "broadcast_object_list": "test_broadcast_object_list",
    "ddp_cpu": "test_DistributedDataParallelCPU",
}
"""op -> torch's test of it (``DistributedTest._DistTestBase``), cheap ones: a few seconds each on a quiet machine.
torch tests all_to_all and the tensor forms of all_gather / reduce_scatter on CPU for MPI only (its Gloo tests
of them are CUDA's), so ``bench collectives --ops`` and the shmops property tests cover those."""


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
