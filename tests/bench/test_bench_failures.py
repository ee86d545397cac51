"""A failed benchmark case is reported by the line that says why, not by torchrun's closing banner."""

from __future__ import annotations

import pytest

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


@pytest.mark.ranks
def test_a_killed_worker_is_reported_by_its_exit_code():
    assert _cause(_TORCHRUN_ABORT) == "a worker exited: exitcode : -6 (pid: 671) (SIGABRT)"


@pytest.mark.ranks
def test_a_worker_exception_beats_the_launcher_traceback():
    stderr = "Traceback (most recent call last):\nValueError: bad batch\n" + _TORCHRUN_ABORT
    assert _cause(stderr) == "ValueError: bad batch"


@pytest.mark.unit
def test_ringtrain_own_error_line_comes_first():
    assert _cause("noise\nringtrain: error: train.lr must be > 0\nmore noise\n") == "train.lr must be > 0"


@pytest.mark.unit
def test_empty_output_still_says_something():
    assert _cause("") == "(no output)"
    assert _cause("just this\n") == "just this"


@pytest.mark.unit
def test_model_parallel_cases_run_their_layout_on_the_batch_of_their_data_ranks(tmp_path, monkeypatch):
    """`ringtrain bench train --strategies tp,fsdp+tp,pp,ddp+pp`: each case's `ringtrain train` gets its
    comm.strategy, its parallel.tp and parallel.pp (1 for the unsplit cases, whatever the config says) and a batch
    for the data-parallel ranks only (a tp group or a pipeline reads one share), set after the bench's own batch
    so that it wins."""
    from ringtrain.bench import training
    from ringtrain.bench.training import TrainCase, parse_strategies, split_degree

    commands = []

    def run(command, case, run_dir, extra_env=None):  # the run itself: only its command line matters here
        commands.append(command)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"type": "train", "step_time_s": 1.0}\n' * 2)

    monkeypatch.setattr(training, "_run", run)
    settings = ["train.global_batch_size=64", "train.max_steps=5"]
    layout = ["train.auto_micro_batch=false", "train.global_batch_size=32"]
    for name, world, expected in [("tp", 2, ["comm.strategy=ddp", "parallel.tp=2", "parallel.pp=1", *layout]),
                                  ("fsdp+tp", 4, ["comm.strategy=fsdp", "parallel.tp=2", "parallel.pp=1", *layout]),
                                  ("pp", 2, ["comm.strategy=ddp", "parallel.tp=1", "parallel.pp=2", *layout]),
                                  ("ddp+pp", 4, ["comm.strategy=ddp", "parallel.tp=1", "parallel.pp=2", *layout]),
                                  ("ddp", 2, ["comm.strategy=ddp", "parallel.tp=1", "parallel.pp=1"])]:
        (strategy, algorithm), = parse_strategies(name)
        case = TrainCase("ringtrain", world, 1, strategy, algorithm)
        training._run_ringtrain("configs/text_lm.toml", case, settings, tmp_path)
        sets = [arg for flag, arg in zip(commands[-1], commands[-1][1:]) if flag == "--set"]
        assert sets == [*settings, *expected], sets
        assert split_degree(case) == (1 if name == "ddp" else 2)
