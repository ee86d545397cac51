"""Where metrics go: a progress bar for people, files for tools, nothing on ranks other than 0.

Every logger has the same four calls, so the training loop never asks which rank it is on:
``start`` once, ``on_step`` after every optimizer step (cheap), ``log`` for each metrics record and
``finish`` with the run's summary.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ringtrain.config import Config, MonitorConfig
from ringtrain.redact import redact

__all__ = ["Logger", "NullLogger", "ConsoleLogger", "RunDirLogger", "MultiLogger", "build_logger"]


class Logger:
    """The interface; also the null logger (``NullLogger``) every rank but 0 gets: every call does nothing."""

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None: ...

    def on_step(self, step: int, epoch: int) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


NullLogger = Logger


class ConsoleLogger(Logger):
    """A rich progress bar on stderr (epoch, step, loss, samples/s, ETA), a line per notice and per evaluation
    above it, and a summary table on stdout."""

    def __init__(self, progress: bool = True):
        self.show_progress = progress
        self.progress: Progress | None = None
        self.task = None
        self.epochs = 1

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        self.epochs = math.ceil(total_steps / steps_per_epoch)
        if not self.show_progress:
            return
        self.progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}/" + str(self.epochs)),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[throughput]} samples/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, epoch=1, loss="-", throughput="-"
        )
        self.progress.start()

    def on_step(self, step: int, epoch: int) -> None:
        if self.progress is not None:
            # After the last step of an epoch the loop has already moved to the next one.
            self.progress.update(self.task, completed=step, epoch=min(epoch + 1, self.epochs))

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind in ("warning", "skip", "resume", "heal", "eval"):
            line = eval_line(record) if kind == "eval" else notice_line(record)
            if self.progress is not None:  # printed above the live bar, which stays at the bottom
                self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                print(line, file=sys.stderr, flush=True)
            return
        if self.progress is not None and record.get("type") == "train":
            self.progress.update(
                self.task, loss=f"{record['loss']:.4f}", throughput=f"{record['samples_per_s']:,.0f}"
            )

    def finish(self, summary: dict[str, Any]) -> None:
        self.close()
        table = Table(title="ringtrain summary", show_header=False)
        for key, value in _flatten(summary).items():
            table.add_row(key, format_value(value))
        Console(file=sys.stdout).print(table)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class RunDirLogger(Logger):
    """Writes the run directory's files: config.toml (given a config), metrics.jsonl (one record a line),
    summary.json; each with its credentials redacted (ringtrain/redact.py: ``http://***@host``, ``api_key =
    "***"``), as every file of the run directory may be read by others.

    Rank 0 writes, every other rank gets the null logger, and the loop calls both alike::

        logger = RunDirLogger(run_dir) if rank == 0 else NullLogger()
        logger.start(total_steps, start_step=step, steps_per_epoch=sampler.steps_per_epoch)
        logger.log({"type": "train", "step": step, "loss": loss, **clock.flush()})
        logger.finish({"steps": step, "accuracy": accuracy})       # summary.json; closes metrics.jsonl
    """

    def __init__(self, run_dir: str | Path, config: Config | None = None):
        self.run_dir = Path(run_dir)
        self.config = config
        self.metrics = None

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config is not None:
            (self.run_dir / "config.toml").write_text(self.config.to_toml())  # credentials redacted
        # Appending keeps the history of a resumed run in one file.
        take_over(self.run_dir / "metrics.jsonl")
        self.metrics = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(redact(record)) + "\n")
        self.metrics.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(redact(summary), indent=2) + "\n")
        self.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def take_over(path: Path) -> None:
    """Replace ``path`` by a copy of itself (a new inode) before a new writer opens it for appending: a handle
    that an earlier writer still holds then writes into the unlinked old file, never into this run's. The
    earlier writer is a worker that a heal cut off (its fence check passed, then it was stopped, and it
    appends once more when it resumes) or any process of an earlier attempt still alive."""
    if path.exists():
        copy = path.with_name(f".{path.name}.take-over")
        shutil.copyfile(path, copy)
        os.replace(copy, path)


class MultiLogger(Logger):
    """Every call to each of ``loggers`` in turn; records and the summary redacted once for all of them (the
    console's lines, metrics.csv, the trackers)."""

    def __init__(self, *loggers: Logger):
        self.loggers = loggers

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        for logger in self.loggers:
            logger.start(total_steps, start_step, steps_per_epoch)

    def on_step(self, step: int, epoch: int) -> None:
        for logger in self.loggers:
            logger.on_step(step, epoch)

    def log(self, record: dict[str, Any]) -> None:
        record = redact(record)
        for logger in self.loggers:
            logger.log(record)

    def finish(self, summary: dict[str, Any]) -> None:
        summary = redact(summary)
        for logger in self.loggers:
            logger.finish(summary)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_logger(config: Config, rank: int, run_dir: str | Path) -> Logger:
    """Real loggers on rank 0, the null logger elsewhere."""
    if rank != 0:
        return NullLogger()
    from ringtrain.monitor.sinks import CsvLogger
    from ringtrain.monitor.trackers import build_trackers

    monitor: MonitorConfig = config.monitor
    # RunDirLogger before the trackers: summary.json and metrics.jsonl are complete when they finish.
    loggers: list[Logger] = [ConsoleLogger(progress=monitor.progress), RunDirLogger(run_dir, config)]
    if monitor.csv:
        loggers.append(CsvLogger(Path(run_dir) / "metrics.csv"))
    loggers += build_trackers(config, run_dir)
    return MultiLogger(*loggers)


def notice_line(record: dict[str, Any]) -> str:
    """The console line of a warning, a skipped step, a heal or a resume record."""
    kind = record["type"]
    if kind == "warning":
        return f"ringtrain: warning: {record['message']}"
    if kind == "skip":
        return f"ringtrain: step {record['step']} skipped on every rank: {record['reason']}"
    if kind == "heal":
        lost = record["lost_ranks"]
        who = f"rank {lost[0]}" if len(lost) == 1 else "ranks " + ", ".join(map(str, lost))
        going_on = "1 worker goes on" if record["world_size"] == 1 else f"{record['world_size']} workers go on"
        return (f"ringtrain: healed at step {record['step']}: {who} lost, {going_on} "
                f"(generation {record['generation']}); training again {record['recovery_s']:.2f} s after the last "
                f"completed step; {record['steps_lost']} steps lost")
    workers = f"{record['world_size']} worker{'s' * (record['world_size'] != 1)}"
    source = f"{record['checkpoint']} (step {record['step']})" if record["checkpoint"] else "the start (no checkpoint yet)"
    if not record.get("restart"):
        return f"ringtrain: resumed from {source} with {workers}"
    line = f"ringtrain: restart {record['restart']}: resumed from {source} with {workers}"
    if "steps_lost" in record:
        line += f"; {record['steps_lost']} step{'s' * (record['steps_lost'] != 1)} lost"
    if "restart_s" in record:
        line += f"; training again {record['restart_s']:.1f} s after the last completed step"
    return line


def eval_line(record: dict[str, Any]) -> str:
    """The console line of an evaluation record: ``eval at step 230 (epoch 10): accuracy 0.9778, loss 0.1060``
    (every number it holds but the sample count, in the record's order; lists such as per-class metrics stay in
    metrics.jsonl)."""
    skip = ("type", "step", "epoch", "count")
    values = ", ".join(f"{key} {format_value(value)}" for key, value in record.items()
                       if key not in skip and isinstance(value, (int, float)) and not isinstance(value, bool))
    return f"eval at step {record['step']} (epoch {record['epoch']}): {values}"


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def format_value(value: Any) -> str:
    """A summary or eval value for people: counts as integers (``920``, ``20,575``), other numbers with 4
    significant digits (``820.1``, ``0.9778``, ``0.001505``), whole numbers from 1000 on with separators;
    per-rank digests as one value when the ranks agree."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return f"{value[0][:12]}… on all {len(value)} ranks" if len(set(value)) == 1 else ", ".join(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and math.isfinite(value):
        # 999.96 rounds to 4 digits as "1000.": the thousands form says it better.
        return f"{value:,.0f}" if abs(value) >= 999.95 else f"{value:#.4g}"
    return str(value)
