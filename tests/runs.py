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


def json_lines(path: Path) -> list[dict]:
    """The complete JSON lines of a file that may still be appended to (a line still being written is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


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
