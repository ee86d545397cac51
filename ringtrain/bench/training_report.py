"""Files of `ringtrain bench train`: train_bench.json, train_bench.md and two PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from ringtrain.bench.training import TrainResult  # noqa: E402

__all__ = ["write_train_bench"]


def write_train_bench(results: list[TrainResult], out_dir: Path, command: str) -> str:
    """Write the JSON rows, the Markdown table and the plots; return the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_bench.json").write_text(json.dumps([r.row() for r in results], indent=2) + "\n")
    _plot_throughput(results, out_dir / "train_throughput.png")
    _plot_breakdown(results, out_dir / "train_breakdown.png")
    if any(r.model_state_mb for r in results):
        _plot_memory(results, out_dir / "train_memory.png")
    markdown = _table(results, command)
    (out_dir / "train_bench.md").write_text(markdown)
    return markdown


def _table(results: list[TrainResult], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| runner | workers | accum | global batch | median step ms | samples/s | scaling eff. | exposed comm | "
        "monitoring | model state MB | peak RSS MB | step / bare | weights = bare |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in results:
        c = r.case
        eff = f"{r.scaling_efficiency:.1%}" if r.scaling_efficiency is not None else ""
        overhead = f"{r.overhead_vs_bare:.3f}" if r.overhead_vs_bare is not None else ""
        same = {None: "", True: "yes", False: "NO"}[r.bit_identical_to_bare]
        comm = f"{r.comm_exposed_fraction:.1%}" if c.runner != "bare" else ""
        monitoring = f"{r.monitor_fraction:.2%}" if c.runner != "bare" else ""
        memory = f"{r.peak_rss_mb:,.0f}" if r.peak_rss_mb else ""
        state = f"{r.model_state_mb:,.1f}" if r.model_state_mb else ""
        lines.append(
            f"| {c.label} | {c.world_size} | {c.grad_accum_steps} | {r.global_batch_size} | {r.median_step_s * 1e3:.2f} "
            f"| {r.samples_per_s:,.0f} | {eff} | {comm} | {monitoring} | {state} | {memory} | {overhead} | {same} |"
        )
    return "\n".join(lines) + "\n"


def _plot_throughput(results: list[TrainResult], path: Path) -> None:
    """Samples/s against workers, one line per (strategy, accumulation), with the linear ideal."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[TrainResult]] = {}
    for r in results:
        series.setdefault(f"{r.case.label}, accum {r.case.grad_accum_steps}", []).append(r)
    for label, rows in series.items():
        rows.sort(key=lambda r: r.case.world_size)
        line, = ax.plot([r.case.world_size for r in rows], [r.samples_per_s for r in rows], marker="o", label=label)
        single = next((r for r in rows if r.case.world_size == 1), None)
        if single is not None:
            workers = [r.case.world_size for r in rows]
            ax.plot(workers, [w * single.samples_per_s for w in workers], linestyle=":", color=line.get_color())
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s (dotted: linear ideal)")
    ax.set_xticks(sorted({r.case.world_size for r in results}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_memory(results: list[TrainResult], path: Path) -> None:
    """Model state and peak RSS per strategy, one group of bars per worker count."""
    rows = [r for r in results if r.model_state_mb]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows)), 4.5))
    names = [f"{r.case.label}\nn={r.case.world_size}" for r in rows]
    for ax, values, title in ((axes[0], [r.model_state_mb for r in rows], "model state MB (largest rank)"),
                              (axes[1], [r.peak_rss_mb for r in rows], "peak RSS MB (largest rank)")):
        ax.bar(range(len(rows)), values, color=["C%d" % (r.case.world_size - 1) for r in rows])
        ax.set_xticks(range(len(rows)), names, fontsize="small", rotation=45, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_breakdown(results: list[TrainResult], path: Path) -> None:
    """Mean step time split into phases, one stacked bar per ringtrain case."""
    rows = [r for r in results if r.breakdown_s]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    names = [f"{r.case.label}\nn={r.case.world_size} a={r.case.grad_accum_steps}" for r in rows]
    bottoms = [0.0] * len(rows)
    for phase in rows[0].breakdown_s if rows else ():
        heights = [r.breakdown_s[phase] * 1e3 for r in rows]
        ax.bar(names, heights, bottom=bottoms, label=phase.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms per optimizer step (mean)")
    ax.tick_params(axis="x", labelsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
