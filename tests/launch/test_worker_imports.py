"""Every worker process imports the trainer and ends: what it imports at start-up and does at exit is paid
once per worker, per launch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ringtrain.data import digits


@pytest.mark.job
def test_a_worker_imports_neither_scikit_learn_nor_torch_distributed_checkpoint_until_used():
    probe = ("import sys, ringtrain.worker, ringtrain.train.loop; "
             "print(sorted(m for m in ('sklearn', 'torch.distributed.checkpoint', 'transformers', 'timm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"heavy modules imported at worker start-up: {out.strip()}"


@pytest.mark.unit
def test_the_kept_digits_split_equals_the_computed_one_and_a_damaged_file_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGTRAIN_CACHE_DIR", str(tmp_path))
    first = digits.load_digits_split(0.25, 3)
    (kept,) = tmp_path.glob("digits-*.pt")
    again = digits.load_digits_split(0.25, 3)
    computed = digits._split(0.25, 3)
    for split in (first, again):
        got = (*split.train.tensors, *split.test.tensors)
        assert all(torch.equal(a, b) for a, b in zip(got, computed, strict=True))
    assert len(first.train) + len(first.test) == 1797 and first.input_shape == (64,)
    kept.write_bytes(b"not a torch file")
    damaged = digits.load_digits_split(0.25, 3)
    assert torch.equal(damaged.train.tensors[0], computed[0])
    assert digits._read(kept) is not None, "the damaged file is replaced by a good one"


@pytest.mark.job
def test_exit_quickly_still_joins_threads_runs_atexit_and_flushes_output(tmp_path):
    marks = tmp_path / "marks"
    script = f"""
import atexit, sys, threading, time
from ringtrain.group.lifetime import exit_quickly
marks = open({str(marks)!r}, "a")
atexit.register(lambda: (marks.write("atexit\\n"), marks.flush()))
def late():
    time.sleep(0.3)
    marks.write("thread\\n"); marks.flush()
threading.Thread(target=late).start()
sys.stdout.write("buffered, no newline")
exit_quickly(3)
marks.write("never\\n")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stdout == "buffered, no newline"
    assert marks.read_text().splitlines() == ["thread", "atexit"]
