"""`make test` runs three test processes side by side (pytest-xdist); a test marked ``exclusive``, and a block in
``alone()``, run with no other test beside them, while the others do overlap (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.job

pytest.importorskip("xdist")

_TESTS = '''
import json, os, time
import pytest
from tests.conftest import alone

def note(name, start):
    with open(os.environ["SIDE_BY_SIDE_LOG"], "a") as log:
        log.write(json.dumps({"name": name, "start": start, "end": time.monotonic()}) + "\\n")

@pytest.mark.parametrize("k", range(6))
def test_shared(k):
    start = time.monotonic(); time.sleep(0.3); note(f"shared-{k}", start)

@pytest.mark.exclusive
def test_exclusive():
    start = time.monotonic(); time.sleep(0.6); note("exclusive", start)

@pytest.mark.parametrize("k", range(2))
def test_block_alone(k):
    time.sleep(0.1)
    with alone():
        start = time.monotonic(); time.sleep(0.4); note(f"alone-{k}", start)
    time.sleep(0.1)
'''


def test_exclusive_tests_and_alone_blocks_run_with_no_other_test_beside_them(tmp_path):
    (tmp_path / "test_timeline.py").write_text(textwrap.dedent(_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "timeline.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SIDE_BY_SIDE_LOG": str(log)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-n", "2", "-p", "no:cacheprovider", "-q",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    spans = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(spans) == 9, spans

    def overlap(a, b):
        return a["start"] < b["end"] and b["start"] < a["end"]

    lone = [s for s in spans if not s["name"].startswith("shared")]
    for span in lone:
        beside = [o["name"] for o in spans if o is not span and overlap(span, o)]
        assert not beside, f"{span['name']} ran beside {beside}"
    # The others did run side by side: else the check above would hold for a suite run in one process.
    shared = [s for s in spans if s["name"].startswith("shared")]
    assert any(overlap(a, b) for i, a in enumerate(shared) for b in shared[i + 1:]), spans
