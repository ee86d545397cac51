"""A worker that dies of a signal in native code (here SIGABRT, as a C++ library's ``terminate`` raises it) prints
every thread's Python stack before it goes: the launcher turns on Python's faulthandler for its workers, so a
crash names the function it happened in (a user's own PYTHONFAULTHANDLER setting is kept)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.job

SCRIPT = '''
import os


def load_the_native_library():
    os.abort()


load_the_native_library()
'''


def test_an_aborted_worker_prints_where_it_was(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT)
    done = run_cli("run", str(script), "--nproc", "1", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert done.returncode != 0
    assert "Fatal Python error: Aborted" in done.stderr, done.stderr[-2000:]
    assert 'in load_the_native_library' in done.stderr, done.stderr[-2000:]
    assert "SIGABRT" in done.stderr, done.stderr[-2000:]
