"""What a job leaves in its run directory, read one way by every test, and the ``ringtrain train`` command line
the tests build (issue 45: these were written out again in each test file).

    result = run_cli(*train_args("configs/debug_mlp.toml", run_dir, "train.max_steps=4"))
    assert summary(run_dir)["steps"] == 4 and losses(run_dir)[4] < losses(run_dir)[1]

``records``, ``losses``, ``last_step`` and ``ledger_steps`` may read a file a running job is appending to: a line
still being written is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["summary", "json_lines", "records", "losses", "last_step", "ledger_steps", "train_args"]


def summary(run_dir: Path) -> dict:
    """The run's summary.json (written once, at the end of a finished run)."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


_parsed: dict[str, tuple[bytes, list[dict]]] = {}
"""path -> (the file's bytes up to its last newline, their JSON lines) when it was last read: a chaos test polls a
growing ledger every 10 ms, and parsing all of it each time took a fifth of a core (300 steps: 2.8 ms a read)."""


def json_lines(path: Path) -> list[dict]:
    """The complete JSON lines of a file that may still be appended to (a line still being written is left out)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    data = data[:data.rfind(b"\n") + 1]  # complete lines only
    key = str(path)
    known, parsed = _parsed.pop(key, (b"", []))
    if not data.startswith(known):  # rewritten (a resume cuts its ledger back): read from the start
        known, parsed = b"", []
    parsed = parsed + [_loads(line) for line in data[len(known):].splitlines()]
    parsed = [record for record in parsed if record is not None]
    _parsed[key] = (data, parsed)
    while len(_parsed) > 64:  # the oldest files: their tests are over
        del _parsed[next(iter(_parsed))]
    return list(parsed)


def _loads(line: bytes) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:  # a line left torn by a killed writer
        return None


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """metrics.jsonl's records of type ``kind`` ('train', 'eval', 'heal', ...), or all of them."""
    return [r for r in json_lines(Path(run_dir) / "metrics.jsonl") if kind is None or r.get("type") == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """The training loss by step, as metrics.jsonl logged it."""
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def last_step(run_dir: Path) -> int:
    """The newest step metrics.jsonl logged (0 before the first)."""
    return max((r["step"] for r in records(run_dir, "train")), default=0)


def ledger_steps(run_dir: Path) -> list[dict]:
    """ledger.jsonl's step records (each with its ranks' sample ids)."""
    return [r for r in json_lines(Path(run_dir) / "ledger.jsonl") if "ids" in r]


def train_args(config: str, run_dir: Path, *settings: str, nproc: int = 2) -> list[str]:
    """``ringtrain train CONFIG --nproc NPROC --run-dir RUN_DIR --set S ...``'s arguments (after ``ringtrain``)."""
    return ["train", config, "--nproc", str(nproc), "--run-dir", str(run_dir),
            *(arg for setting in settings for arg in ("--set", setting))]
