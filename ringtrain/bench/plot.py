"""Plots of benchmark results (matplotlib, no display needed)::

    >>> plot_busbw(rows, "bench-out/collectives.png")
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_busbw"]


def plot_busbw(rows: list[dict], path: str | Path, title: str = "all_reduce bus bandwidth") -> Path:
    """Bus bandwidth against message size, one panel per world size, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    world_sizes = sorted({row["world_size"] for row in rows})
    fig, axes = plt.subplots(1, len(world_sizes), figsize=(5.2 * len(world_sizes), 3.8), squeeze=False, sharey=True)
    for ax, world_size in zip(axes[0], world_sizes):
        mine = [row for row in rows if row["world_size"] == world_size]
        for algorithm in dict.fromkeys(row["algorithm"] for row in mine):
            points = sorted((row["bytes"], row["busbw_gbps"]) for row in mine if row["algorithm"] == algorithm)
            ax.plot([b for b, _ in points], [g for _, g in points], marker="o", markersize=3, label=algorithm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # Gloo's small messages and shm's large ones are 1000x apart
        sizes = sorted({row["bytes"] for row in mine})
        ticks = sizes[:: max(1, len(sizes) // 6)]
        ax.set_xticks(ticks, [_size_label(b) for b in ticks])
        ax.set_xlabel("message size")
        ax.set_title(f"{world_size} ranks")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _size_label(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
