"""Shared fixtures. Each test process and each worker it starts uses one compute thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ringtrain ARGS`` as a user runs it; returns the finished process (never raises on exit code)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli
