"""The short form of the benchmark across test hosts (the long one: docs/benchmarks.md, "Across hosts")."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_bench_collectives_across_two_capped_hosts(make_hosts, tmp_path):
    make_hosts(1)  # skips without root; the benchmark makes its own hosts
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "bench/hosts_collectives.py", "--hosts", "2", "--nproc", "2", "--rate", "1gbit",
         "--sizes", "1M", "--iters", "5", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    rows = {row["algorithm"]: row for row in json.loads((out / "collectives.json").read_text())}
    # shm across hosts is reported as what it is: the hierarchical all-reduce.
    assert sorted(rows) == ["hierarchical", "ring", "ring_chunked", "torch"], rows
    assert all(row["world_size"] == 4 for row in rows.values())
    # Flat Gloo's busbw is what each link carries: it cannot beat the 1 Gbit/s cap (0.125 GB/s).
    assert rows["torch"]["busbw_gbps"] < 0.125 * 1.05, rows["torch"]
