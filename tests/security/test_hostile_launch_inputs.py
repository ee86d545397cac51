"""What a launcher reads before any worker starts, made hostile (issue 39, row 9): a config of invalid UTF-8, and
SLURM variables naming 10^11 tasks or 10^8 nodes, are each one line and exit 2, at once, with no traceback
(ringtrain/config/loading.py, ringtrain/cluster.py). In the test's process, as tests/workloads/test_config.py does."""

from __future__ import annotations

import time

import pytest

from ringtrain.cluster import MAX_NODES, LaunchFlags, NodelistError, expand_nodelist, fill_launch_flags, nodelist_size
from ringtrain.errors import LaunchError
from tests.conftest import run_main
from tests.launch.test_cluster import slurm

pytestmark = pytest.mark.unit

QUICK_S = 5.0
"""Each refusal, in the test's process (torch imported already): before, the node list took 6-12 s and gigabytes."""


def _refused_in_one_line(result, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_config_of_invalid_utf8_is_one_line_exit_2(tmp_path):
    config = tmp_path / "latin1.toml"
    config.write_bytes("[train]\nlr = 0.1\n# café, saved as Latin-1\n".encode("latin-1"))
    result = run_main("train", str(config), "--run-dir", str(tmp_path / "run"))
    # Before: UnicodeDecodeError, a traceback of 23 lines, exit 1.
    line = _refused_in_one_line(result, str(config), "is not UTF-8 text", "line 3", "save the config as UTF-8")
    assert len(line) < 300
    assert not (tmp_path / "run").exists()
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)) * 100)
    _refused_in_one_line(run_main("config", str(binary)), "is not UTF-8 text")


@pytest.mark.parametrize("variables, words", [
    ({"SLURM_TASKS_PER_NODE": "1(x99999999999)"}, ["SLURM tasks per node '1(x99999999999)'", f"more than {MAX_NODES}"]),
    ({"SLURM_TASKS_PER_NODE": "1(x60000),1(x60000)"}, [f"more than {MAX_NODES}"]),
    ({"SLURM_JOB_NODELIST": "node[1-100000000]"}, ["names 100000000 hosts, SLURM_NNODES says 2"]),
    ({"SLURM_JOB_NODELIST": "r[1-100000]n[1-100000]"}, ["names 10000000000 hosts"]),
    ({"SLURM_JOB_NODELIST": "node[1-" + "9" * 5000 + "]"}, ["not a number or a range like 01-04"]),
    ({"SLURM_TASKS_PER_NODE": "1(x" + "9" * 5000 + ")"}, ["is not in SLURM's form"]),
    ({"SLURM_NNODES": "9" * 5000}, ["SLURM_NNODES=", "is not a whole number"]),
    ({"SLURM_NNODES": "100000000", "SLURM_JOB_NUM_NODES": "100000000"}, [f"not between 1 and {MAX_NODES}"]),
])
def test_slurm_variables_naming_absurd_counts_are_one_line_exit_2_at_once(tmp_path, monkeypatch, variables, words):
    for name, value in slurm(**variables).items():
        monkeypatch.setenv(name, value)
    run_main("config")  # torch and the CLI imported before the clock starts
    started = time.monotonic()
    result = run_main("train", "configs/debug_mlp.toml", "--run-dir", str(tmp_path / "run"))
    elapsed = time.monotonic() - started
    line = _refused_in_one_line(result, *words)
    assert len(line) < 400, line
    assert elapsed < QUICK_S, f"{elapsed:.1f} s to refuse"
    assert not (tmp_path / "run").exists()


def test_a_node_list_is_counted_without_being_expanded():
    started = time.monotonic()
    assert nodelist_size("node[1-100000000]") == 10**8
    assert nodelist_size("node[01-04,07],gpu-[8-10]-ib,login") == len(expand_nodelist("node[01-04,07],gpu-[8-10]-ib,login")) == 9
    assert nodelist_size("r[1-2]n[1-3]") == 6
    with pytest.raises(NodelistError, match=f"names 100000001 hosts, more than {MAX_NODES}"):
        expand_nodelist("a[0-100000000]")
    assert time.monotonic() - started < QUICK_S
    assert len(expand_nodelist(f"n[1-{MAX_NODES}]")) == MAX_NODES  # the bound itself is a list SLURM could give


def test_the_allocations_still_accepted_are_unchanged():
    filled = fill_launch_flags(LaunchFlags(), slurm(SLURM_TASKS_PER_NODE="1(x2)"))
    assert filled.flags.nnodes == "2" and filled.flags.rdzv_endpoint == "gpu-007-ib:33765"
    with pytest.raises(LaunchError, match="srun started tasks per node 2,1"):
        fill_launch_flags(LaunchFlags(), {k: v for k, v in slurm(SLURM_TASKS_PER_NODE="2,1").items()
                                          if k not in ("SLURM_NTASKS",)})
