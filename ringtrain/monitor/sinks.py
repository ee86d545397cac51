"""File sinks for tools: metrics.csv (one row per logged training step) and TensorBoard event files.

metrics.jsonl (RunDirLogger) stays the complete record; these are views of it for spreadsheets and
TensorBoard. Both are rank-0 loggers with the Logger interface.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from ringtrain.monitor.loggers import Logger, take_over

__all__ = ["CsvLogger", "TensorBoardLogger"]

# Phases that appear only on some steps; reserved so the CSV header, fixed by the first row, has them.
_OCCASIONAL = ("time/monitor_s", "time/eval_s", "time/checkpoint_s")


class CsvLogger(Logger):
    """Training records as CSV; the columns are those of the first record plus the occasional phases."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = None
        self.writer: csv.DictWriter | None = None

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        take_over(self.path)  # an earlier writer's open handle no longer reaches the table

    def log(self, record: dict[str, Any]) -> None:
        if record.get("type") != "train":
            return
        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            columns = [k for k in record if k != "type"] + [k for k in _OCCASIONAL if k not in record]
            exists = self.path.exists() and self.path.stat().st_size > 0
            self.file = self.path.open("a", newline="", encoding="utf-8")
            self.writer = csv.DictWriter(self.file, fieldnames=columns, extrasaction="ignore", restval="")
            if not exists:  # a resumed run appends to the same table
                self.writer.writeheader()
        self.writer.writerow(record)
        self.file.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            self.writer = None


class TensorBoardLogger(Logger):
    """Every numeric field as a scalar: training fields under ``train/``, evaluation under ``eval/``."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: ringtrain[tensorboard]

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        group = record.get("type", "train")
        for key, value in record.items():
            if key in ("type", "step") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            self.writer.add_scalar(f"{group}/{key}", value, global_step=record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
