"""A run's attempts, read back from metrics.jsonl: what ``ringtrain report`` sums over the whole run.

A run directory keeps one metrics.jsonl across ``--resume`` and restarts (each writer appends), and summary.json
is written by the last attempt alone (its ``wall_s`` and ``samples_per_s`` are that attempt's). Each resumed
attempt logs one ``"resume"`` record (the checkpoint, its step, the workers, the restart count, the steps lost),
so the file splits into attempts at those records. An attempt's training time is the sum of its train records'
intervals (``step_time_s`` × the steps since the record before; the clock starts when training starts), its
samples the same intervals × ``samples_per_s``: the time to its last record (for a crashed attempt the steps
after that record are not timed; the next resume record counts them as lost). The last attempt takes
summary.json's figures when summary.json is its own, which also time its steps after the last record.

    attempts = split_attempts(records)
    totals = RunTotals.of(attempts, summary)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Attempt", "RunTotals", "split_attempts"]


@dataclass
class Attempt:
    """One stretch of training by one set of processes: the run's start, or a resume (or restart) of it."""

    number: int
    began: dict[str, Any] | None
    """The resume record that began it; None for the run's first attempt."""
    train: list[dict[str, Any]] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    training_s: float = 0.0
    samples: float = 0.0
    finished_step: int | None = None
    """The step it finished at (from its summary.json), when it finished."""

    @property
    def start_step(self) -> int:
        return int(self.began["step"]) if self.began else 0

    @property
    def end_step(self) -> int:
        """The step it finished at, or the step of its last train record."""
        if self.finished_step is not None:
            return self.finished_step
        return int(self.train[-1]["step"]) if self.train else self.start_step

    @property
    def steps_lost(self) -> int:
        """Steps trained before this attempt began that it had to redo (its resume record's), plus its heals'."""
        lost = int(self.began.get("steps_lost", 0)) if self.began else 0
        return lost + sum(int(h.get("steps_lost", 0)) for h in self.heals)

    def describe(self) -> str:
        """How the attempt began, for people."""
        if self.began is None:
            return "start"
        began = self.began
        workers = f"{began['world_size']} worker{'s' * (began['world_size'] != 1)}"
        source = began["checkpoint"] or "the start (no checkpoint yet)"
        how = f"restart {began['restart']}" if began.get("restart") else "--resume"
        return f"{how} from {source} (step {began['step']}) with {workers}"

    def _add_interval(self, record: dict[str, Any], previous_step: int) -> None:
        steps = int(record["step"]) - previous_step
        seconds = record.get("step_time_s")
        if steps > 0 and isinstance(seconds, (int, float)):
            self.training_s += seconds * steps
            self.samples += seconds * steps * float(record.get("samples_per_s", 0.0))


def split_attempts(records: list[dict[str, Any]]) -> list[Attempt]:
    """The records' attempts in order; each train record's interval timed into its attempt."""
    attempts = [Attempt(1, None)]
    previous_step = 0
    for record in records:
        kind = record.get("type")
        if kind == "resume":
            attempts.append(Attempt(len(attempts) + 1, record))
            previous_step = int(record["step"])
        elif kind == "heal":
            attempts[-1].heals.append(record)
            # A heal that reloaded a checkpoint redoes the steps since it: the next interval starts there.
            previous_step = min(previous_step, int(record["step"]) - 1 - int(record.get("steps_lost", 0)))
        elif kind == "train":
            attempts[-1]._add_interval(record, previous_step)
            attempts[-1].train.append(record)
            previous_step = int(record["step"])
    if len(attempts) > 1 and not attempts[0].train:
        # Nothing was logged before the first resume: a run directory started from --resume-from, or a
        # metrics.jsonl that an earlier attempt never wrote to.
        attempts.pop(0)
        for number, attempt in enumerate(attempts, start=1):
            attempt.number = number
    return attempts


@dataclass
class RunTotals:
    """The whole run's figures, summed over its attempts."""

    final_step: int
    training_s: float
    samples: float
    restarts: int
    resumes: int
    heals: int
    steps_lost: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.training_s if self.training_s > 0 else 0.0

    @classmethod
    def of(cls, attempts: list[Attempt], summary: dict[str, Any]) -> RunTotals:
        last = attempts[-1]
        if summary.get("wall_s") is not None and int(summary.get("steps", -1)) >= last.end_step:
            # summary.json is the last attempt's own (written when it finished; an older one, of an attempt
            # before, has fewer steps): it times the attempt to its end.
            last.finished_step = int(summary["steps"])
            last.training_s = float(summary["wall_s"])
            last.samples = float(summary.get("samples_per_s", 0.0)) * last.training_s
        began = [a.began for a in attempts if a.began is not None]
        return cls(
            final_step=last.end_step,
            training_s=sum(a.training_s for a in attempts),
            samples=sum(a.samples for a in attempts),
            restarts=sum(1 for b in began if b.get("restart")),
            resumes=sum(1 for b in began if not b.get("restart")),
            heals=sum(len(a.heals) for a in attempts),
            steps_lost=sum(a.steps_lost for a in attempts),
        )
