"""The exactly-once ledger: per committed step, the sample ids each rank used (``RUN_DIR/ledger.jsonl``).

With ``[data] ledger = true`` every rank hands its step's ids to rank 0 (one gather per step), which
appends one line per step::

    {"step": 12, "epoch": 0, "world_size": 2, "ids": [[...rank 0...], [...rank 1...]], "skipped": false}

On every (re)start the ledger is cut back to the step the job resumed from, so it always describes the
history of the weights that exist: steps lost in a crash and redone after the restart appear once.
``check_ledger`` (and ``ringtrain ledger RUN_DIR``) proves each epoch used every sample exactly once,
across restarts and changes of the number of workers.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ringtrain.checkpoint.manifest import write_atomic
from ringtrain.comm.objects import gather_ints
from ringtrain.errors import RingtrainError
from ringtrain.testing import faults

__all__ = ["Ledger", "NullLedger", "EpochReport", "read_ledger", "check_ledger", "build_ledger", "CorruptLedger"]

LEDGER_FILE = "ledger.jsonl"


class NullLedger:
    """Recording switched off: no collective, no file."""

    def start(self, resumed_step: int) -> None: ...

    def record(self, step: int, epoch: int, ids: list[int], skipped: bool) -> None: ...

    def close(self) -> None: ...


class Ledger(NullLedger):
    """Gathers every rank's ids each step; only the writer (rank 0) holds the file."""

    def __init__(self, path: Path, num_samples: int, is_writer: bool, group: dist.ProcessGroup | None = None):
        self.path = path
        self.num_samples = num_samples
        self.is_writer = is_writer
        self.group = group
        """The ranks whose ids are gathered (None: all; under tensor parallelism, one rank of each
        tensor-parallel group, whose peers read the same samples)."""
        self.file = None

    def start(self, resumed_step: int) -> None:
        """Cut the ledger back to ``resumed_step`` (the weights' history) and open it for appending."""
        if not self.is_writer:
            return
        kept = [r for r in read_ledger(self.path) if r.get("step", 0) <= resumed_step and "ids" in r]
        header = {"type": "header", "num_samples": self.num_samples}
        lines = [json.dumps(header)] + [json.dumps(r) for r in kept]
        # Temp file, fsync, rename, fsync the folder: a crash leaves the old ledger or the cut one, whole.
        write_atomic(self.path, lambda f: f.write("".join(line + "\n" for line in lines).encode("utf-8")))
        self.file = self.path.open("a", encoding="utf-8")

    def record(self, step: int, epoch: int, ids: list[int], skipped: bool) -> None:
        """One committed step; every rank calls it (a gather to rank 0)."""
        gathered = _gather_to_writer(ids, self.group)
        faults.point("ledger.gathered")
        self.write(step, epoch, gathered, skipped)

    def write(self, step: int, epoch: int, gathered: list[list[int]], skipped: bool) -> None:
        """The writer's line for one step, every rank's ids given (``record`` gathers them)."""
        if self.file is None:
            return
        record = {"step": step, "epoch": epoch, "world_size": len(gathered), "ids": gathered, "skipped": skipped}
        # One write per line and a flush: a crash tears at most the last line, which start() drops.
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def last_step(self) -> int:
        """The last step the file records (0: none)."""
        return max((r["step"] for r in read_ledger(self.path) if "ids" in r), default=0)


def build_ledger(enabled: bool, run_dir: str | Path, num_samples: int, rank: int, group: dist.ProcessGroup | None = None,
                 leader: bool = True) -> NullLedger:
    """``group``: the data-parallel ranks whose ids are gathered (None: all); ``leader``: this rank is one of
    them (under tensor parallelism the other ranks of its group hold the same ids and record nothing)."""
    if not enabled or not leader:
        return NullLedger()
    return Ledger(Path(run_dir) / LEDGER_FILE, num_samples, is_writer=rank == 0, group=group)


class CorruptLedger(RingtrainError, ValueError):
    """A ledger line that is JSON but not a record ringtrain writes (a torn line is not JSON: it is dropped)."""


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a ledger file (a torn last line from a crash is left out). JSON only, so a
    planted file runs nothing; a line of the wrong shape is CorruptLedger naming the file and line."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        problem = _record_problem(record)
        if problem:
            raise CorruptLedger(f"ledger {path} line {number} {problem}, not a line ringtrain writes; move the file "
                                "away (the run writes a new one) or fix the line")
        records.append(record)
    return records


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}"
    if record.get("type") == "header" and not _is_count(record.get("num_samples")):
        return "is a header without a whole num_samples"
    if "ids" in record:
        if not all(_is_count(record.get(key)) for key in ("step", "epoch", "world_size")):
            return "is a step without a whole step, epoch and world_size"
        ids = record["ids"]
        if not (isinstance(ids, list) and all(isinstance(r, list) and all(_is_count(i) for i in r) for r in ids)):
            return "holds ids that are not one list of whole numbers per rank"
    return None


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    used: int
    """Sample uses recorded in this epoch (all ranks, all steps)."""
    duplicates: int
    """Uses beyond the first of the same sample."""
    missing: int
    """Samples of the dataset never used (0 for a complete epoch; the rest of the last, unfinished one)."""
    complete: bool
    world_sizes: tuple[int, ...]
    """The world sizes this epoch ran at, in order of appearance."""

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and (self.missing == 0 or not self.complete)


def check_ledger(path: str | Path) -> list[EpochReport]:
    """Per epoch: uses, duplicates and missing samples. Only the last epoch may be incomplete."""
    records = read_ledger(path)
    header = next((r for r in records if r.get("type") == "header"), None)
    if header is None:
        raise ValueError(f"{path} is not a ringtrain ledger (no header line)")
    num_samples = header["num_samples"]
    steps = [r for r in records if "ids" in r]
    epochs = sorted({r["epoch"] for r in steps})
    reports = []
    for epoch in epochs:
        in_epoch = [r for r in steps if r["epoch"] == epoch]
        counts = Counter(i for r in in_epoch for ids in r["ids"] for i in ids)
        used = sum(counts.values())
        complete = epoch != epochs[-1] or len(counts) == num_samples
        sizes = tuple(dict.fromkeys(r["world_size"] for r in in_epoch))
        reports.append(EpochReport(epoch, used, used - len(counts), num_samples - len(counts), complete, sizes))
    return reports


def _gather_to_writer(ids: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [ids]
    gathered = gather_ints(ids, dst=0, group=group)  # int64s, not pickle: no peer's bytes are unpickled
    return gathered or []
