"""A failed benchmark case is reported by the line that says why, not by torchrun's closing banner."""

from __future__ import annotations

from ringtrain.bench.training import _cause

# What torchrun printed when a bare DDP worker aborted at exit (trimmed).
_TORCHRUN_ABORT = """terminate called without an active exception
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
====================================================
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 671)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 671
====================================================
"""


def test_a_killed_worker_is_reported_by_its_exit_code():
    assert _cause(_TORCHRUN_ABORT) == "a worker exited: exitcode : -6 (pid: 671) (SIGABRT)"


def test_a_worker_exception_beats_the_launcher_traceback():
    stderr = "Traceback (most recent call last):\nValueError: bad batch\n" + _TORCHRUN_ABORT
    assert _cause(stderr) == "ValueError: bad batch"


def test_ringtrain_own_error_line_comes_first():
    assert _cause("noise\nringtrain: error: train.lr must be > 0\nmore noise\n") == "train.lr must be > 0"


def test_empty_output_still_says_something():
    assert _cause("") == "(no output)"
    assert _cause("just this\n") == "just this"
