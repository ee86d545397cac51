"""``ringtrain run``'s launcher check of the layout it can know (ringtrain/config/loading.py
check_override_degrees): the [parallel] degrees ``--set`` gives must divide the number of workers, whatever the
script's config holds; refused in one line before any worker starts."""

from __future__ import annotations

import pytest

from ringtrain.config import check_override_degrees
from ringtrain.errors import ConfigError
from tests.conftest import REPO, run_main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides, world_sizes", [
    (["parallel.tp=2"], (4, 4)),
    (["parallel.tp=2", "parallel.pp=2"], (4, 4)),
    (["parallel.dp_replicate=-1", "parallel.tp=3"], (6, 6)),  # -1: the rest, whatever it is
    (["train.lr=0.1"], (3, 3)),
])
def test_degrees_that_divide_every_world_size_pass(overrides, world_sizes):
    check_override_degrees(overrides, *world_sizes)


@pytest.mark.parametrize("overrides, world_sizes, words", [
    (["parallel.tp=2"], (3, 3), "[parallel] tp (2) set by --set: 2 does not divide world_size (3)"),
    (["parallel.tp=2", "parallel.cp=2"], (6, 6), "tp (2) x cp (2) set by --set: 4 does not divide world_size (6)"),
    (["parallel.pp=2"], (2, 3), "(the job runs with 2 to 3 workers; this is at 3)"),
])
def test_degrees_that_do_not_divide_are_one_line(overrides, world_sizes, words):
    with pytest.raises(ConfigError) as err:
        check_override_degrees(overrides, *world_sizes)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_ringtrain_run_refuses_them_before_any_worker_starts(tmp_path):
    """The issue's case: ``ringtrain run --nproc 3 --set parallel.tp=2`` (ringtrain.cli.main in this process: were
    it not refused, the launcher would start the three workers)."""
    result = run_main("run", str(REPO / "examples" / "digits_cnn_fit.py"), "--nproc", "3", "--set", "parallel.tp=2",
                      "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "ringtrain: error: [parallel] tp (2) set by --set: 2 does not divide world_size (3), and the layout's degrees "
        "multiply to it; run a multiple of 2 workers (--nproc), or change the degrees"]
    assert not (tmp_path / "run").exists()
