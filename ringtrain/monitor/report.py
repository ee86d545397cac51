"""``ringtrain report RUN_DIR [--compare OTHER_RUN]``: a run's metrics as plots and a short Markdown summary.

The summary answers "where does the time go?": the mean step split into its phases (data wait,
forward/backward, exposed communication, optimizer, ...), how much communication hid behind compute, the
straggler, memory. With ``--compare`` it answers "why is the bigger run not N× faster?": scaling
efficiency, and the change of each phase of the step between the two runs. A run that was resumed or
restarted is reported whole: its totals sum every attempt (monitor/run_history.py), and each attempt is a row.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtrain.errors import RingtrainError
from ringtrain.monitor.loggers import format_value
from ringtrain.monitor.run_history import Attempt, RunTotals, split_attempts

__all__ = ["RunMetrics", "load_run", "write_report", "PHASES"]

# Step phases in the order they happen, as the loop books them (metric key: time/<phase>_s).
PHASES = ("data", "forward_backward", "tp_comm", "cp_comm", "pipeline_wait", "comm_exposed", "optimizer", "monitor", "eval", "checkpoint")
_PHASE_LABELS = {
    "data": "data wait",
    "forward_backward": "forward+backward",
    "tp_comm": "tensor-parallel communication (the split layers' all-reduces waited for)",
    "cp_comm": "context-parallel communication (ring attention's key/value blocks waited for)",
    "pipeline_wait": "pipeline wait (bubble and activation transfers)",
    "comm_exposed": "exposed communication",
    "optimizer": "optimizer",
    "monitor": "monitoring",
    "eval": "evaluation",
    "checkpoint": "checkpointing",
}


@dataclass
class RunMetrics:
    """What a run directory holds, parsed; ``steady`` are the training records after warm-up."""

    name: str
    path: Path
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    summary: dict[str, Any]
    attempts: list[Attempt]
    totals: RunTotals

    @property
    def steady(self) -> list[dict[str, Any]]:
        # Each attempt's first interval holds start-up costs (allocations, first-touch, DDP's first bucket rebuild).
        return [r for a in self.attempts for r in (a.train[1:] if len(a.train) > 2 else a.train)]

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size", 1))

    def median(self, key: str) -> float:
        values = [r[key] for r in self.steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else 0.0

    def mean(self, key: str) -> float:
        """Mean over steady records; a record without ``key`` counts as 0 (a phase that did not run)."""
        values = [r.get(key, 0.0) for r in self.steady]
        return statistics.fmean(values) if values else 0.0

    def phase_means(self) -> dict[str, float]:
        """Seconds per step of each phase. Means, not medians: means add up to the mean step time."""
        return {phase: self.mean(f"time/{phase}_s") for phase in PHASES}


def load_run(path: str | Path) -> RunMetrics:
    """Parse RUN_DIR/metrics.jsonl (and summary.json when the run finished)."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RingtrainError(f"{path} has no metrics.jsonl; pass a run directory written by `ringtrain train`")
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise RingtrainError(f"{metrics}:{number} is not JSON; the file is damaged") from None
    train = [r for r in records if r.get("type") == "train"]
    if not train:
        raise RingtrainError(f"{metrics} holds no training records yet; report a run that has logged a step")
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    attempts = split_attempts(records)
    totals = RunTotals.of(attempts, summary)
    evals = [r for r in records if r.get("type") == "eval"]
    return RunMetrics(path.name, path, train, evals, summary, attempts, totals)


def write_report(runs: list[RunMetrics], out_dir: str | Path) -> Path:
    """Write PNG plots and report.md into ``out_dir``; returns the Markdown file."""
    from ringtrain.monitor.report_plots import plot_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = plot_report(runs, out_dir)
    text = _markdown(runs, images)
    report = out_dir / "report.md"
    report.write_text(text)
    return report


def _markdown(runs: list[RunMetrics], images: list[Path]) -> str:
    lines = [f"# ringtrain report: {' vs '.join(run.name for run in runs)}", ""]
    for run in runs:
        lines += _run_section(run)
    if len(runs) == 2:
        lines += _comparison(*runs)
    lines += ["## Plots", ""] + [f"![{image.stem}]({image.name})" for image in images] + [""]
    return "\n".join(lines)


def _run_section(run: RunMetrics) -> list[str]:
    step_s = run.mean("step_time_s")
    phases = run.phase_means()
    lines = [f"## {run.name}", ""] + _totals_lines(run)
    lines += [
        f"Median step: **{run.median('step_time_s') * 1e3:.2f} ms**, {run.median('samples_per_s'):,.0f} samples/s "
        f"(mean step {step_s * 1e3:.2f} ms, split below).",
        "",
        "| phase | ms per step (mean) | share of step |",
        "| --- | ---: | ---: |",
    ]
    for phase in PHASES:
        if phases[phase] > 0 or phase in ("data", "forward_backward", "comm_exposed", "optimizer"):
            share = phases[phase] / step_s if step_s else 0.0
            lines.append(f"| {_PHASE_LABELS[phase]} | {phases[phase] * 1e3:.2f} | {share:.1%} |")
    accounted = sum(phases.values())
    lines += ["", f"The phases account for {accounted / step_s:.0%} of the step." if step_s else "", ""]
    comm_s = run.mean("time/comm_s")
    exposed_s = phases["comm_exposed"]
    if comm_s > 0:
        hidden = max(0.0, comm_s - exposed_s) / comm_s
        lines.append(
            f"Gradient all-reduces take {comm_s * 1e3:.2f} ms per step and {hidden:.0%} of that hides behind compute; "
            f"the step waits {exposed_s * 1e3:.2f} ms on communication (the last buckets, the step agreement and "
            f"any wait for a slower rank)."
        )
    lines += _straggler_lines(run)
    peak = max((r.get("memory/peak_rss_mb", 0.0) for r in run.train), default=0.0)
    if peak:
        lines.append(f"Peak resident memory (largest rank): {peak:,.0f} MB.")
    return lines + [""]


def _totals_lines(run: RunMetrics) -> list[str]:
    """The whole run in one sentence (every attempt summed), and a row per attempt when there were several."""
    t, s = run.totals, run.summary
    history = []
    for count, what in ((t.resumes, "resume"), (t.restarts, "restart"), (t.heals, "heal")):
        if count:
            history.append(f"{count} {what}{'s' * (count != 1)}")
    at_end = " at the end" if len(run.attempts) > 1 else ""
    workers = f"{s['world_size']} workers{at_end}, " if "world_size" in s else ""
    evaluation = ", ".join(f"{k} {format_value(v)}" for k, v in s.get("eval", {}).items()
                           if isinstance(v, (int, float)))
    attempts = len(run.attempts)
    line = (f"{workers}{t.final_step} steps"
            + (f" in {attempts} attempts ({', '.join(history)})" if attempts > 1 or history else "")
            + f": {t.training_s:.1f} s of training, {t.samples:,.0f} samples, {t.samples_per_s:,.0f} samples/s")
    if t.steps_lost:
        line += f"; {t.steps_lost} step{'s' * (t.steps_lost != 1)} lost to failures and trained again"
    if s.get("final_loss") is not None:
        line += f"; final loss {format_value(s['final_loss'])}"
    lines = [line + (f"; eval: {evaluation}" if evaluation else "") + ".", ""]
    if attempts > 1:
        lines += ["| attempt | began | steps | training time | samples | samples/s |",
                  "| --- | --- | --- | ---: | ---: | ---: |"]
        for a in run.attempts:
            rate = a.samples / a.training_s if a.training_s > 0 else 0.0
            lines.append(f"| {a.number} | {a.describe()} | {a.start_step} → {a.end_step} | {a.training_s:.1f} s "
                         f"| {a.samples:,.0f} | {rate:,.0f} |")
        lines += [f"| **run** | | {t.final_step} | {t.training_s:.1f} s | {t.samples:,.0f} "
                  f"| {t.samples_per_s:,.0f} |", ""]
    return lines


def _straggler_lines(run: RunMetrics) -> list[str]:
    ranks = [r["straggler/rank"] for r in run.steady if "straggler/rank" in r]
    if run.world_size < 2 or not ranks:
        return []
    most = max(set(ranks), key=ranks.count)
    lag = run.median("straggler/lag_s")
    return [
        f"Slowest rank: {most} in {ranks.count(most) / len(ranks):.0%} of intervals; the median lag behind the "
        f"fastest rank is {lag * 1e3:.2f} ms per step ({lag / max(run.median('step_time_s'), 1e-12):.1%} of the step)."
    ]


def _comparison(base: RunMetrics, other: RunMetrics) -> list[str]:
    """Why is ``other`` (more workers) not proportionally faster than ``base``?

    Each phase of ``base`` is scaled to the work per worker of ``other`` (the same for weak scaling,
    smaller for strong scaling): what the step would cost if adding workers were free. The difference
    is the cost of scaling, phase by phase.
    """
    if other.world_size < base.world_size:
        base, other = other, base
    ratio = other.world_size / base.world_size
    base_thr, other_thr = base.median("samples_per_s"), other.median("samples_per_s")
    efficiency = other_thr / (ratio * base_thr) if base_thr else 0.0
    work = _samples_per_worker_step(other) / max(_samples_per_worker_step(base), 1e-12)
    lines = [
        f"## {other.name} ({other.world_size} workers) against {base.name} ({base.world_size})",
        "",
        f"Throughput {base_thr:,.0f} → {other_thr:,.0f} samples/s: {other_thr / base_thr if base_thr else 0:.2f}× "
        f"for {ratio:g}× the workers, a scaling efficiency of **{efficiency:.0%}** "
        f"(throughput / (workers ratio × base throughput); 100% is linear).",
        "",
        f"Per step, each worker of {other.name} processes {work:.2g}× the samples of one in {base.name}. "
        f"With free scaling every phase would take the base time × {work:.2g}; the difference is what "
        "scaling costs:",
        "",
        "| phase (mean ms per step) | base (scaled) | other | cost of scaling |",
        "| --- | ---: | ---: | ---: |",
    ]
    base_phases, other_phases = base.phase_means(), other.phase_means()
    costs = {}
    for phase in PHASES:
        expected = base_phases[phase] * work
        costs[phase] = other_phases[phase] - expected
        if expected or other_phases[phase]:
            lines.append(
                f"| {_PHASE_LABELS[phase]} | {expected * 1e3:.2f} | {other_phases[phase] * 1e3:.2f} "
                f"| {costs[phase] * 1e3:+.2f} |"
            )
    expected_step = base.mean("step_time_s") * work
    step_cost = other.mean("step_time_s") - expected_step
    lines.append(f"| **step** | {expected_step * 1e3:.2f} | {other.mean('step_time_s') * 1e3:.2f} "
                 f"| {step_cost * 1e3:+.2f} |")
    if step_cost > 0:
        culprit = max(costs, key=costs.get)
        lines += ["", f"The largest cost of scaling is **{_PHASE_LABELS[culprit]}**: "
                  f"{costs[culprit] * 1e3:+.2f} ms of the {step_cost * 1e3:+.2f} ms per step."]
        lag = other.median("straggler/lag_s")
        if lag > 0.1 * step_cost:
            lines.append(f"Uneven ranks add to it: the slowest rank lags the fastest by {lag * 1e3:.2f} ms per step.")
    else:
        lines += ["", "Scaling cost no step time here: each worker's step took no longer than the scaled base."]
    return lines + [""]


def _samples_per_worker_step(run: RunMetrics) -> float:
    return run.median("samples_per_s") * run.median("step_time_s") / run.world_size
