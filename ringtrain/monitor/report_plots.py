"""The report's PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

__all__ = ["plot_report"]


def plot_report(runs, out_dir: Path) -> list[Path]:
    """loss.png, eval.png, throughput.png, breakdown.png, comm.png; one line (or panel) per run."""
    from ringtrain.monitor.report import PHASES

    paths = [
        _lines(runs, out_dir / "loss.png", "loss", "training loss (mean over workers)", log_y=True),
        _eval(runs, out_dir / "eval.png"),
        _lines(runs, out_dir / "throughput.png", "samples_per_s", "samples/s"),
        _breakdown(runs, out_dir / "breakdown.png", PHASES),
        _lines(runs, out_dir / "comm.png", "comm_fraction", "exposed communication / step time"),
    ]
    return [p for p in paths if p is not None]


def _lines(runs, path: Path, key: str, label: str, log_y: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        points = [(r["step"], r[key]) for r in run.train if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), label=f"{run.name} ({run.world_size} workers)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _eval(runs, path: Path) -> Path | None:
    keys = sorted({k for run in runs for r in run.eval for k in r if k not in ("type", "step", "epoch", "count")})
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


def _breakdown(runs, path: Path, phases) -> Path:
    """Mean time per step of each phase, stacked, one bar per run, against the measured mean step."""
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(runs)), 4.5))
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
    ax.legend(fontsize="small")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
