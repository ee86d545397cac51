"""Monitoring, report and training benchmark, as a user runs them."""

from __future__ import annotations

import csv
import json
import statistics

import pytest
from PIL import Image

from tests.conftest import alone, run_cli, run_main

# Steps of ~10 ms, so the loop's own statements between phases, and DDP's fixed costs, are a small share.
SIZED = ["--set", "model.hidden_sizes=[1024, 1024]", "--set", "train.local_batch_size=128",
         "--set", "monitor.log_every_steps=5", "--set", "monitor.tensorboard=true"]


def train_records(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "train"][1:]  # the first interval is warm-up


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same job on 1 and on 2 workers (per-worker batch fixed)."""
    out = {}
    for world_size in (1, 2):
        run_dir = tmp_path_factory.mktemp("monitoring") / f"n{world_size}"
        with alone():  # the step breakdown must add up: no other test's processes taking the cores mid-step
            result = run_cli("train", "configs/debug_mlp.toml", "--nproc", str(world_size), "--run-dir", str(run_dir),
                             "--set", f"train.global_batch_size={128 * world_size}", *SIZED)
        assert result.returncode == 0, result.stderr
        out[world_size] = run_dir
    return out


PHASES = ("data", "forward_backward", "comm_exposed", "optimizer", "monitor", "eval", "checkpoint")


@pytest.mark.job
@pytest.mark.parametrize("world_size", [1, 2])
def test_step_breakdown_adds_up_to_the_step_time(runs, world_size):
    records = train_records(runs[world_size])
    step = statistics.fmean(r["step_time_s"] for r in records)
    phases = sum(statistics.fmean(r.get(f"time/{p}_s", 0.0) for r in records) for p in PHASES)
    print(f"world size {world_size}: phases {phases * 1e3:.3f} ms of a {step * 1e3:.3f} ms step")
    assert phases == pytest.approx(step, rel=0.05)


@pytest.mark.job
def test_exposed_communication_is_zero_alone_and_positive_with_two(runs):
    alone = statistics.fmean(r["comm_fraction"] for r in train_records(runs[1]))
    pair = statistics.fmean(r["comm_fraction"] for r in train_records(runs[2]))
    print(f"exposed communication: {alone:.2%} of the step with 1 worker, {pair:.2%} with 2")
    assert alone < 0.03, "alone, a worker has nothing to communicate"
    assert pair > max(3 * alone, 0.01), "two workers must wait for their gradient all-reduce"


@pytest.mark.job
def test_records_carry_memory_straggler_and_sinks(runs):
    record = train_records(runs[2])[-1]
    assert record["memory/peak_rss_mb"] > 50
    # Two ranks' busy times, measured apart, are never equal to the nanosecond: a lag of exactly 0.0 is the value
    # the product writes at world size 1 (nothing measured), not a measurement.
    assert record["straggler/rank"] in (0, 1) and record["straggler/lag_s"] > 0
    assert record["time/comm_s"] > 0
    with (runs[2] / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(train_records(runs[2])) + 1 and float(rows[-1]["loss"]) == pytest.approx(record["loss"])
    assert list((runs[2] / "tensorboard").glob("events.out.tfevents.*"))


def assert_png(path):
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG"


@pytest.mark.job
def test_report_compares_runs_and_explains_scaling(runs, tmp_path):
    result = run_main("report", str(runs[1]), "--compare", str(runs[2]), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "report.md").read_text()
    assert "scaling efficiency" in report and "| phase (mean ms per step) | base (scaled) |" in report
    assert "The largest cost of scaling is" in report or "Scaling cost no step time" in report
    for name in ("loss", "eval", "throughput", "breakdown", "comm"):
        assert_png(tmp_path / f"{name}.png")


@pytest.mark.unit
def test_report_of_a_missing_run_is_one_line(tmp_path):
    result = run_main("report", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("ringtrain: error:") and "metrics.jsonl" in result.stderr


@pytest.mark.job
def test_bench_train_runs_ringtrain_beside_bare_ddp(tmp_path):
    result = run_cli("bench", "train", "configs/debug_mlp.toml", "--nproc", "1,2", "--steps", "15", "--interval", "5",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr + "".join(p.read_text() for p in tmp_path.rglob("bench_stderr.log"))
    rows = json.loads((tmp_path / "train_bench.json").read_text())
    assert {(r["runner"], r["world_size"]) for r in rows} == {("bare", 1), ("bare", 2), ("ringtrain", 1), ("ringtrain", 2)}
    ours = [r for r in rows if r["runner"] == "ringtrain"]
    assert all(r["bit_identical_to_bare"] for r in ours), "ringtrain DDP and bare DDP must train the same weights"
    assert all(r["median_step_s"] > 0 and r["overhead_vs_bare"] > 0 for r in ours)
    assert next(r for r in ours if r["world_size"] == 1)["scaling_efficiency"] == 1.0
    assert "| ddp | 2 |" in (tmp_path / "train_bench.md").read_text()
    assert_png(tmp_path / "train_throughput.png")
    assert_png(tmp_path / "train_breakdown.png")
