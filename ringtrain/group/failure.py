"""Why a worker failed, told to the launcher in the error file its elastic agent reads.

torch's agent reads each failed worker's ``TORCHELASTIC_ERROR_FILE`` (a message and a timestamp in whole
seconds) and hands the launcher every failure at once. Which one was the cause is not in it: a worker whose
peer raised fails too, a second later, in a collective. So a worker adds what it knows, under ``"ringtrain"``:

- ``kind``: ``"usage"`` (a ``RingtrainError`` with exit code 2: a config, part or checkpoint that does not fit;
  the launcher prints the worker's line once and exits 2), ``"cause"`` (an error that started on this rank:
  the user's exception, whose traceback is in ``RUN_DIR/logs/rank-R.traceback``), or ``"consequence"`` (this
  rank failed because another did: a collective whose peer died or stopped, a stop signal);
- ``time``: when, to the microsecond (the first cause wins);
- ``line``: the worker's one line, ``[rank R] message``; ``traceback``: the file that holds its traceback.

    record_failure(env.error_file, "cause", f"[rank 1] KeyError: 'logit'", traceback="runs/x/logs/rank-1.traceback")
    report = failure_report(failure.message)    # in the launcher: the dict above, or None
"""

from __future__ import annotations

import json
import os
import time
import traceback as tb
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "record_failure", "failure_report", "write_traceback", "traceback_path"]

KINDS = ("usage", "cause", "consequence")
_KEY = "ringtrain"


def traceback_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps the traceback of the exception that ended it (the latest attempt's)."""
    return Path(run_dir) / "logs" / f"rank-{rank}.traceback"


def write_traceback(run_dir: str | Path | None, rank: int, err: BaseException) -> Path | None:
    """The exception's whole traceback in ``traceback_path``; None when it cannot be written (no run directory
    yet, or the folder is not writable): then the caller shows the traceback itself."""
    if run_dir is None:
        return None
    path = traceback_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(tb.format_exception(err)))
    except OSError:
        return None
    return path


def record_failure(error_file: str | None, kind: str, line: str, exc: BaseException | None = None,
                   traceback: str | Path | None = None) -> None:
    """Write the error file torch's agent reads (its format: message, extraInfo with py_callstack and a
    timestamp in seconds), with ringtrain's report beside; nothing without an agent."""
    if error_file is None:
        return
    now = time.time()
    message = f"{type(exc).__name__}: {exc}" if exc is not None else line
    data = {"message": {
        "message": message,
        "extraInfo": {"py_callstack": "".join(tb.format_exception(exc)) if exc is not None else "",
                      "timestamp": str(int(now))},
        _KEY: {"kind": kind, "time": now, "line": line, "traceback": str(traceback) if traceback else None},
    }}
    try:
        Path(error_file).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{error_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, error_file)
    except OSError:
        pass  # the agent then reports the exit code alone


def failure_report(message: Any) -> dict[str, Any] | None:
    """ringtrain's report in a failure's message (a ``ProcessFailure.message``), or None (a worker that died
    before it could write one, or a program that is not ringtrain's)."""
    report = message.get(_KEY) if isinstance(message, dict) else None
    if not isinstance(report, dict) or report.get("kind") not in KINDS or not isinstance(report.get("line"), str):
        return None
    return report
