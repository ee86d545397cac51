"""The report's PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

__all__ = ["plot_report", "breakdown_figure"]


def plot_report(runs, out_dir: Path) -> list[Path]:
    """loss.png, lr.png, eval.png, throughput.png, breakdown.png, comm.png; one line (or bar) per run."""
    from ringtrain.monitor.report import PHASES

    paths = [
        _lines(runs, out_dir / "loss.png", "loss", "training loss (mean over workers)", log_y=True),
        _lines(runs, out_dir / "lr.png", "lr", "learning rate"),
        _eval(runs, out_dir / "eval.png"),
        _lines(runs, out_dir / "throughput.png", "samples_per_s", "samples/s"),
        _save(breakdown_figure(runs, PHASES), out_dir / "breakdown.png"),
        _lines(runs, out_dir / "comm.png", "comm_fraction", "exposed communication / step time"),
    ]
    return [p for p in paths if p is not None]


def _lines(runs, path: Path, key: str, label: str, log_y: bool = False) -> Path | None:
    """``key`` of the train records against the step. Each attempt of a resumed or restarted run is a line of
    its own in the run's colour (steps redone after a crash would otherwise draw the line back over itself),
    a dotted line marks where it began."""
    if not any(isinstance(r.get(key), (int, float)) for run in runs for r in run.train):
        return None  # e.g. no lr in the records of an older run
    fig, ax = plt.subplots(figsize=(7, 4))
    for index, run in enumerate(runs):
        color = f"C{index}"
        label_run = f"{run.name} ({run.world_size} workers)"
        for attempt in run.attempts:
            points = [(r["step"], r[key]) for r in attempt.train if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), color=color, label=label_run)
                label_run = None  # one legend entry per run
            if attempt.began is not None:
                ax.axvline(attempt.start_step, color=color, linestyle=":", alpha=0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _eval(runs, path: Path) -> Path | None:
    keys = sorted({k for run in runs for r in run.eval for k, v in r.items()
                   if k not in ("type", "step", "epoch", "count") and isinstance(v, (int, float))})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for run in runs:
            points = [(r["step"], r[key]) for r in run.eval if key in r]
            if points:
                ax.plot(*zip(*points), marker="o", label=run.name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"eval {key}")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def breakdown_figure(runs, phases):
    """Mean time per step of each phase, stacked, one bar per run, against the measured mean step. The legend
    stands to the right of the axes, where it covers no bar."""
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(runs)) + 2, 4.5))
    bottoms = [0.0] * len(runs)
    names = [f"{run.name}\n({run.world_size} workers)" for run in runs]
    for phase in phases:
        heights = [run.phase_means()[phase] * 1e3 for run in runs]
        if any(heights):
            ax.bar(names, heights, bottom=bottoms, label=phase.replace("_", " "))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    steps = [run.mean("step_time_s") * 1e3 for run in runs]
    ax.scatter(names, steps, color="black", marker="_", s=800, zorder=3, label="measured step time")
    ax.set_ylabel("ms per optimizer step (mean)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    # "tight": the saved image grows to hold a legend placed outside the axes.
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
