"""bench/hosts_training.py's grid and table (the measurements themselves: docs/benchmarks.md)."""

from __future__ import annotations

from bench.hosts_training import Case, cases, table
import pytest

pytestmark = pytest.mark.unit


def test_the_grid_runs_single_host_layouts_once_and_cross_host_layouts_per_rate():
    grid = cases(["lm"], ["1x1", "1x4", "2x2"], ["torch", "bf16"], ["1gbit", "100mbit"])
    names = [case.name for case in grid]
    assert names == ["lm-1x1-torch-local", "lm-1x4-torch-local", "lm-1x4-bf16-local",
                     "lm-2x2-torch-1gbit", "lm-2x2-torch-100mbit", "lm-2x2-bf16-1gbit", "lm-2x2-bf16-100mbit"]
    assert Case("lm", 2, 2, "torch", "1gbit").workers == 4


def _row(hosts: int, per_host: int, algorithm: str, rate: str | None, samples_per_s: float) -> dict:
    case = Case("lm", hosts, per_host, algorithm, rate)
    return {"workload": "lm", "hosts": hosts, "per_host": per_host, "algorithm": algorithm, "rate": rate,
            "layout": case.layout, "workers": case.workers, "name": case.name, "samples_per_s": samples_per_s,
            "step_time_s": 1.0, "comm_exposed_s": 0.1}


def test_the_table_gives_efficiency_against_one_worker_and_the_ratio_to_one_namespace():
    rows = [_row(1, 1, "torch", None, 10.0), _row(1, 4, "torch", None, 20.0), _row(2, 2, "torch", "1gbit", 15.0),
            _row(2, 2, "bf16", "100mbit", 8.0)]
    text = table(rows)
    assert "| 1x1 | loopback | torch | 10.0 | 1000 ms | 100 ms | 100% | - |" in text
    assert "| 1x4 | loopback | torch | 20.0 | 1000 ms | 100 ms | 50% | - |" in text
    # 15 / (4 x 10) and 15 / 20: the same four workers in one namespace.
    assert "| 2x2 | 1gbit | torch | 15.0 | 1000 ms | 100 ms | 38% | 0.75x |" in text
    assert "| 2x2 | 100mbit | bf16 | 8.0 | 1000 ms | 100 ms | 20% | - |" in text  # no bf16 in one namespace
    assert text.index("| 2x2 | 1gbit |") < text.index("| 2x2 | 100mbit |")
