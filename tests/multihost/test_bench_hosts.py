"""The short forms of the benchmarks across test hosts (the long ones: docs/benchmarks.md, "Across hosts" and
"Training across hosts")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.hosts


def test_bench_collectives_across_two_capped_hosts(make_hosts, tmp_path):
    # make_hosts skips without root; the benchmark makes its own hosts
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


def test_bench_training_across_two_capped_hosts_and_its_prediction(make_hosts, tmp_path):
    """bench/hosts_training.py end to end at its smallest: the digits MLP on 2 hosts x 1 worker over a 1 Gbit/s
    link, Gloo and the bf16 hook, against the same two workers in one namespace; then the cost model's
    prediction for each case across hosts."""
    out = tmp_path / "training"
    command = [sys.executable, "bench/hosts_training.py", "--workloads", "mlp", "--rates", "1gbit", "--steps", "4",
               "--interval", "1", "--out", str(out)]
    # The cost model needs Gloo's compute in one namespace; bf16 there is not needed: two runs of the grid.
    for grid in (["--layouts", "1x2", "--algorithms", "torch"], ["--layouts", "2x1", "--algorithms", "torch,bf16"]):
        result = subprocess.run([*command, *grid], cwd=REPO, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["name"]: row for row in json.loads((out / "results.json").read_text())}
    assert sorted(rows) == ["mlp-1x2-torch-local", "mlp-2x1-bf16-1gbit", "mlp-2x1-torch-1gbit"], sorted(rows)
    for row in rows.values():
        assert row["workers"] == 2 and row["samples_per_s"] > 0 and 0 < row["step_time_s"] < 10, row
    table = (out / "table.md").read_text()
    # Gloo across hosts against the same two workers in one namespace: the ratio is filled in.
    ratio = rows["mlp-2x1-torch-1gbit"]["samples_per_s"] / rows["mlp-1x2-torch-local"]["samples_per_s"]
    assert f"| 2x1 | 1gbit | torch | {rows['mlp-2x1-torch-1gbit']['samples_per_s']:.1f} |" in table
    assert f"| {ratio:.2f}x |" in table, table
    assert "| 2x1 | 1gbit | bf16 |" in table and "| 1x2 | loopback | torch |" in table, table
    # The prediction: stated links (this machine's shared memory, as `ringtrain plan calibrate` measures it).
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"links": {"shm": {"alpha_s": 0.0, "beta_Bps": 5e8, "name": "shm"}}}))
    result = subprocess.run([*command, "--predict", str(links)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    predicted = {case["name"]: case for case in json.loads((out / "predicted.json").read_text())}
    assert sorted(predicted) == ["mlp-2x1-bf16-1gbit", "mlp-2x1-torch-1gbit"], predicted
    for name, case in predicted.items():
        assert case["measured_step_ms"] == rows[name]["step_time_s"] * 1e3
        assert case["predicted_step_ms"] > 0
        assert case["error"] == pytest.approx(case["predicted_step_ms"] / case["measured_step_ms"] - 1)
        assert f"| {name} |" in (out / "predicted.md").read_text()
    # The same compute, half the bytes on the wire: bf16 cannot be predicted slower than Gloo.
    assert predicted["mlp-2x1-bf16-1gbit"]["predicted_step_ms"] <= predicted["mlp-2x1-torch-1gbit"]["predicted_step_ms"]
