"""The launcher's one line about a failed job, from the error files its workers wrote (group/failure.py).

torch's agent hands the launcher every failed worker at once (``ChildFailedError``); each worker's error file
says whether its failure started the job's end (``cause``), was a usage error (``usage``) or came from a peer's
(``consequence``). These build the agent's failures from real error files, as torch reads them.
"""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ringtrain.group.failure import record_failure
from ringtrain.errors import LaunchError
from ringtrain.launch import WorkerFailed, _describe_failure

pytestmark = pytest.mark.unit


def failures(tmp_path, *workers) -> ChildFailedError:
    """``workers``: (rank, exit code, kind or None, line, traceback) in the order they failed."""
    found = {}
    for rank, exitcode, kind, line, traceback in workers:
        error_file = tmp_path / f"error-{rank}.json"
        if kind is not None:
            record_failure(str(error_file), kind, line, RuntimeError(line), traceback=traceback)
        found[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("train.py", found)


def test_the_rank_whose_own_error_started_it_is_named_even_rank_0_and_reported_later(tmp_path):
    err = failures(tmp_path, (0, 1, "cause", "[rank 0] KeyError: 'logit'", "runs/x/logs/rank-0.traceback"),
                   (1, 1, "consequence", "[rank 1] step 1: all_reduce failed: rank 0 is gone", None))
    reported = _describe_failure(ChildFailedError("train.py", dict(reversed(err.failures.items()))))
    assert isinstance(reported, WorkerFailed) and reported.exit_code == 1
    assert str(reported) == ("worker rank 0 (local rank 0, pid 1000) exited with code 1: KeyError: 'logit' "
                             "(traceback: runs/x/logs/rank-0.traceback) (1 other worker stopped too)")


def test_a_usage_error_with_the_others_stopped_is_the_workers_line_and_exit_2(tmp_path):
    err = failures(tmp_path, (1, 2, "usage", "[rank 1] train_data is a Stream; ...", None),
                   (0, -signal.SIGTERM, None, "", None))
    reported = _describe_failure(err)
    assert isinstance(reported, LaunchError) and reported.exit_code == 2
    assert str(reported) == "[rank 1] train_data is a Stream; ..."


def test_a_usage_error_beside_another_workers_own_error_is_a_worker_failure(tmp_path):
    err = failures(tmp_path, (1, 2, "usage", "[rank 1] bad config", None),
                   (0, 1, "cause", "[rank 0] ValueError: boom", "t"))
    reported = _describe_failure(err)
    assert isinstance(reported, WorkerFailed) and reported.exit_code == 1 and "rank 1" in str(reported)


def test_a_worker_killed_from_outside_is_the_cause(tmp_path):
    err = failures(tmp_path, (0, 1, "consequence", "[rank 0] step 3: all_reduce failed: rank 1 is gone", None),
                   (1, -signal.SIGKILL, None, "", None))
    assert str(_describe_failure(err)).startswith("worker rank 1 (local rank 1, pid 1001) was killed by SIGKILL")


def test_only_peers_failures_name_the_first_of_them(tmp_path):
    err = failures(tmp_path, (0, 1, "consequence", "[rank 0] step 3: all_reduce failed: rank 1 did not respond", None),
                   (1, -signal.SIGTERM, None, "", None))
    assert "worker rank 0 " in str(_describe_failure(err)) and "rank 1 did not respond" in str(_describe_failure(err))


class Writes:
    """A stderr that keeps each write() call: what an unbuffered stream (``python -u``) makes a syscall each."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_workers_error_line_is_one_write_so_ranks_sharing_a_pipe_cannot_splice_their_lines(tmp_path, monkeypatch):
    from ringtrain.errors import ConfigError
    from ringtrain.group.env import DistEnv
    from ringtrain.worker import report_error, report_exception

    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    env = DistEnv(rank=1, world_size=2, master_addr="127.0.0.1", error_file=str(tmp_path / "error.json"))
    report_error(ConfigError("train.lr must be positive"), env)
    try:
        report_exception(KeyError("logit"), env, str(tmp_path))
    except SystemExit as ended:
        assert ended.code == 1
    assert len(stderr.calls) == 2, stderr.calls
    assert stderr.calls[0] == "ringtrain: error: [rank 1] train.lr must be positive\n"
    assert stderr.calls[1].startswith("ringtrain: error: [rank 1] KeyError: 'logit' (traceback: ")
    assert stderr.calls[1].endswith(".traceback)\n")
