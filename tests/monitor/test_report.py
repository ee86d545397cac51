"""`ringtrain report` on a run that was restarted: totals over every attempt, a row per attempt, the learning
rate plotted, and a legend that covers no bar. The run directory is written here as the loop writes it (records
of the same shape), with known intervals, so every figure of the report can be checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from ringtrain.monitor import report_plots
from ringtrain.monitor.report import PHASES, load_run
from tests.conftest import run_main

pytestmark = pytest.mark.unit

STEP_S = {1: 0.010, 2: 0.020}  # seconds per step in each attempt
RATE = {1: 6400.0, 2: 3200.0}  # samples/s: 64 samples a step


def train_record(step: int, attempt: int, lr: float) -> dict:
    step_s = STEP_S[attempt]
    phases = {"data": 0.1, "forward_backward": 0.5, "comm_exposed": 0.2, "optimizer": 0.15, "monitor": 0.05}
    return {"type": "train", "step": step, "epoch": step // 23, "loss": 1.0 / step, "lr": lr, "step_time_s": step_s,
            "samples_per_s": RATE[attempt], **{f"time/{p}_s": share * step_s for p, share in phases.items()},
            "time/comm_s": 0.3 * step_s, "comm_fraction": 0.2, "memory/rss_mb": 900.0, "memory/peak_rss_mb": 910.0,
            "model_state_mb": 0.58, "straggler/rank": 1, "straggler/lag_s": 0.0001}


def write_restarted_run(run_dir: Path) -> None:
    """Attempt 1 logs steps 10..50 and dies at step 57 (checkpoint at 40); the launcher restarts it from step 40
    (17 steps lost), and attempt 2 runs to step 100 and finishes."""
    run_dir.mkdir()
    records = [train_record(step, 1, 0.1) for step in range(10, 51, 10)]
    records.insert(2, {"type": "eval", "step": 23, "epoch": 1, "accuracy": 0.8, "loss": 0.6, "count": 360})
    records.append({"type": "warning", "message": "skipping step_00000050.pt: its manifest is missing"})
    records.append({"type": "resume", "checkpoint": "step_00000040.pt", "step": 40, "world_size": 2, "restart": 1,
                    "steps_lost": 17, "restart_s": 3.2})
    records += [train_record(step, 2, 0.05) for step in range(50, 101, 10)]
    records.append({"type": "eval", "step": 100, "epoch": 4, "accuracy": 0.95, "loss": 0.2, "count": 360})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # The last attempt's own summary: its 60 steps took 1.3 s (the last record's interval and the final eval).
    summary = {"world_size": 2, "steps": 100, "epochs": 4.35, "wall_s": 1.3, "samples_per_s": 3000.0,
               "final_loss": 0.01, "eval": {"accuracy": 0.95, "loss": 0.2}, "restarts": 1, "heals": 0}
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def restarted(tmp_path) -> Path:
    write_restarted_run(tmp_path / "run")
    return tmp_path / "run"


def test_the_report_of_a_restarted_run_sums_every_attempt(restarted, tmp_path):
    result = run_main("report", str(restarted), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    # Attempt 1: 50 steps x 10 ms = 0.5 s, 3,200 samples; attempt 2: summary.json's 1.3 s x 3,000 = 3,900 samples.
    assert ("2 workers at the end, 100 steps in 2 attempts (1 restart): 1.8 s of training, 7,100 samples, "
            "3,944 samples/s; 17 steps lost to failures and trained again; final loss 0.01000; eval: accuracy 0.9500, "
            "loss 0.2000.") in report, report
    assert "| 1 | start | 0 → 50 | 0.5 s | 3,200 | 6,400 |" in report
    assert ("| 2 | restart 1 from step_00000040.pt (step 40) with 2 workers | 40 → 100 | 1.3 s | 3,900 | 3,000 |"
            in report)
    assert "| **run** | | 100 | 1.8 s | 7,100 | 3,944 |" in report


def test_every_attempt_drops_its_own_warm_up_interval(restarted):
    run = load_run(restarted)
    assert [r["step"] for r in run.steady] == [20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert [a.number for a in run.attempts] == [1, 2]
    # Phase means weigh both attempts' steady records: (4 x 10 ms + 5 x 20 ms) / 9.
    assert run.mean("step_time_s") == pytest.approx((4 * 0.010 + 5 * 0.020) / 9)


def test_the_report_plots_the_learning_rate(restarted, tmp_path):
    result = run_main("report", str(restarted), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    with Image.open(tmp_path / "out" / "lr.png") as image:
        image.verify()
        assert image.format == "PNG"
    assert "![lr](lr.png)" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("count", [1, 2])
def test_the_breakdown_legend_covers_no_bar(restarted, tmp_path, monkeypatch, count):
    figures = {}
    save = report_plots._save

    def keep(fig, path):
        fig.canvas.draw()  # lays the figure out as saving it does, so the extents below are final
        figures[Path(path).name] = (fig, [a.get_window_extent() for a in fig.axes[0].patches],
                                    fig.axes[0].get_legend().get_window_extent())
        return save(fig, path)

    monkeypatch.setattr(report_plots, "_save", keep)
    runs = [load_run(restarted) for _ in range(count)]
    report_plots.plot_report(runs, tmp_path)
    _, bars, legend = figures["breakdown.png"]
    assert len(bars) == count * len(PHASES[:5])  # the five phases the records hold, a bar each per run
    covered = [bar for bar in bars if bar.overlaps(legend)]
    assert not covered, f"the legend {legend} covers {len(covered)} of {len(bars)} bars"
