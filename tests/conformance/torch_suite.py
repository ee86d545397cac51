"""torch's own c10d tests (``DistributedTest._DistTestBase``) run against ringtrain's ``ringtrain_shm`` backend.

This module is the suite itself, named so that pytest's default collection (``test_*.py``) skips it: the whole
set is ``make conformance`` (``tests/conformance/run.py``), and the normal suite runs one test per op from it
(``tests/conformance/test_conformance_ops.py``). Run it by hand as ``run.py`` does::

    WORLD_SIZE=3 python -m pytest -p no:cacheprovider tests/conformance/torch_suite.py -k test_all_reduce_sum

torch runs this class for Gloo the same way (``test/distributed/test_distributed_spawn.py``: the environment's
``BACKEND`` and ``WORLD_SIZE``, one process per rank, a fresh process group a test), except that the ranks are
forked from the pytest process rather than spawned (``TestRingtrainShm.setUp``: seconds a test, not minutes).
The test-only registration: torch gates tests by backend name (``BACKEND != "gloo"``, ``DistTestCases.backend_feature``),
evaluated when ``distributed_test`` is imported. It is imported with ``BACKEND=gloo``, so ringtrain_shm is held
to exactly Gloo's CPU test set; then the module's ``BACKEND`` (and the environment's, read inside some tests) is
set to ``ringtrain_shm``, so every process group the tests create -- the default group, ``new_group`` sub-groups,
DDP's -- is ringtrain_shm's, and ``dist.get_backend()`` says so. The profiler checks look for
``f"{dist.get_backend()}:<op>"`` events, i.e. ``ringtrain_shm:all_reduce``: ringtrain_shm joins torch's lists of
backends whose collectives are profiled, so those checks run rather than being skipped. Tests excluded on
purpose are listed, each with its reason, in ``exclusions.py``, as are the few that branch on the backend's name
while they run and have no branch but Gloo's for a CPU backend (``AS_GLOO``: run with the name read as gloo).
"""

from __future__ import annotations

import os
import sys

import pytest

# Each rank a process forked from the pytest process (setUp below); tests/conftest.py asks every test for its cost.
pytestmark = pytest.mark.ranks

if "WORLD_SIZE" not in os.environ:  # collected without run.py's environment: nothing to run
    pytest.skip("torch's c10d conformance suite: run through tests/conformance/run.py (make conformance)",
                allow_module_level=True)

os.environ["BACKEND"] = "gloo"  # read once, at import, by torch's gating decorators
os.environ.setdefault("TEMP_DIR", "/tmp")  # replaced per test (initialize_temp_directories); read at import

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

from ringtrain.comm.c10d_backend import BACKEND  # noqa: E402 - importing it registers "ringtrain_shm"
from tests.conformance.exclusions import AS_GLOO, EXCLUDED  # noqa: E402

# The test-only registration: ringtrain_shm has Gloo's CPU features for torch's runtime checks too.
distributed_test.BACKEND = BACKEND
os.environ["BACKEND"] = BACKEND
for _name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
    getattr(distributed_test, _name).append(BACKEND)
for _features in DistTestCases.backend_feature.values():
    if "gloo" in _features:
        _features.add(BACKEND)
for _skipped in DistTestCases.skip_collective.values():
    if "gloo" in _skipped:
        _skipped.add(BACKEND)
assert dist.Backend(BACKEND) == BACKEND


class TestRingtrainShm(TestDistBackend, DistributedTest._DistTestBase):
    """torch's distributed tests, every rank a forked process, the process group ringtrain_shm's."""

    def setUp(self):
        super().setUp()
        # Each rank is forked from this process, which has imported torch, its test module and ringtrain already,
        # not spawned (torch's default), which imports them afresh in every rank of every test: 5 s of CPU a rank,
        # 106 s for test_gather_checks at load 25 on the 2-core machine, 15 s forked. CPU ranks only (torch
        # spawns because a fork after CUDA is initialised is unsafe); this process runs no collective itself.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def test_ringtrain_process_groups_are_ringtrain_shm(self):
        """ringtrain's own check of the registration (not torch's): the groups torch's tests run on -- the
        default one and a ``new_group`` -- are ringtrain_shm's, and its collectives' profiler events are asked
        for by name. Without it, a registration that fell back to Gloo would pass every test on Gloo."""
        from ringtrain.comm.c10d_backend import ShmProcessGroup

        subgroup = dist.new_group(list(range(dist.get_world_size())))
        for group in (dist.group.WORLD, subgroup):
            self.assertIsInstance(group, ShmProcessGroup)
            self.assertEqual(dist.get_backend(group), BACKEND)
        for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            self.assertIn(BACKEND, getattr(distributed_test, name))
        self._barrier()


for _test, _why in EXCLUDED.items():
    if not hasattr(TestRingtrainShm, _test):
        raise AssertionError(f"exclusions.py names {_test!r}, which torch's suite does not have (any more)")

    def _excluded(self, _why=_why):
        self.skipTest(f"excluded: {_why}")

    setattr(TestRingtrainShm, _test, _excluded)

for _test in AS_GLOO:
    def _as_gloo(self, _body=getattr(TestRingtrainShm, _test)):
        from ringtrain.comm.c10d_backend import ShmProcessGroup

        self.assertIsInstance(dist.group.WORLD, ShmProcessGroup)  # the group the test's DDP runs on
        distributed_test.BACKEND = "gloo"
        try:
            _body(self)
        finally:
            distributed_test.BACKEND = BACKEND

    setattr(TestRingtrainShm, _test, _as_gloo)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
