"""The per-process entry point: one training worker.

Started by ``ringtrain train`` through torch's elastic agent, or directly by plain torchrun::

    torchrun --nproc-per-node 2 -m ringtrain.worker configs/digits_mlp.toml
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from ringtrain.config import load_config, validate_for_world_size
from ringtrain.group.env import DistEnv
from ringtrain.group.failure import record_failure, write_traceback
from ringtrain.group.init import init_distributed
from ringtrain.group.lifetime import STOP_SIGNALS, exit_quickly, exit_with_parent, finish_process
from ringtrain.group.watch import CollectiveFailed
from ringtrain.errors import RingtrainError
from ringtrain.heal.membership import Fenced, MemberFailed
from ringtrain.train.guards import Stopped
from ringtrain.train.run import ResumeWords, plan_resume, run_joined_training, run_training

__all__ = ["main", "forked", "build_worker_parser", "report_error", "report_exception", "tell_exception", "uncaught_reporter"]


def build_worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.worker", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable)")
    parser.add_argument("--run-dir", help="run directory (default: runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument("--resume-from", metavar="PATH", help="start from this checkpoint (a new run directory)")
    return parser


@record
def main(argv: list[str] | None = None) -> None:
    args = build_worker_parser().parse_args(argv)
    env = DistEnv.from_environ()
    # A worker never outlives its agent: an orphan would keep training against a group that moved on.
    exit_with_parent()
    config = None
    try:
        config = load_config(args.config, args.overrides, run_dir=args.run_dir)
        if env.heal_join:  # `ringtrain join` of a --heal job: the running workers admit this one
            run_joined_training(config, env)
            return
        validate_for_world_size(config, env.world_size)
        asked = Path(args.resume_from) if args.resume_from else bool(args.resume)
        plan = plan_resume(env, asked, config, ResumeWords(), checked=env.launched_by_ringtrain)
        with init_distributed(env, config.dist) as ctx:
            run_training(config, ctx, plan)
    except RingtrainError as err:
        report_error(err, env)
        sys.exit(err.exit_code)
    except Exception as err:  # a factory's own code (or a bug): its traceback in the run directory
        report_exception(err, env, config.run_dir if config is not None else None)


def forked(argv: list[str]) -> None:
    """A worker forked from its launcher's forkserver (launch.py), where torch, torch._dynamo and ringtrain's
    trainer are imported once for all the node's workers: it runs as ``python -u -m ringtrain.worker ARGV``
    would (a factory module in the working folder imports: train/user_parts.py), with a process title that
    names it and its rank
    (``ps`` shows ``ringtrain.worker rank 1/4: CONFIG ...``). Multiprocessing ends the process with
    os._exit, so the exit's own work (atexit handlers, non-daemon threads, flushes) is done here."""
    import signal

    import setproctitle

    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in the forkserver (launch.py)
    sys.argv = [__file__, *argv]
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    setproctitle.setproctitle(f"ringtrain.worker rank {rank}/{world}: {' '.join(argv)}")
    try:
        main(argv)
    finally:
        finish_process()


_CONSEQUENCES = (CollectiveFailed, Stopped, Fenced, MemberFailed)
"""Errors a rank gets because another rank failed (or the job was stopped): never the cause to report."""


def report_error(err: RingtrainError, env: DistEnv) -> None:
    """One line on stderr, and the agent's error file, where the launcher finds why each worker failed.

    A usage error (exit code 2) under ringtrain's launcher is left to the launcher, which prints it once for
    all workers; any other line comes at once, while the agent may still be stopping the other workers."""
    kind = "usage" if err.exit_code == 2 else "consequence" if isinstance(err, _CONSEQUENCES) else "cause"
    line = f"[rank {env.rank}] {err}"
    record_failure(env.error_file, kind, line, err)
    if isinstance(err, Stopped):
        if env.rank == 0:
            say(f"ringtrain: [rank 0] {err}")
    elif not (kind == "usage" and env.launched_by_ringtrain):
        say(f"ringtrain: error: {line}")


def report_exception(err: Exception, env: DistEnv, run_dir: str | None) -> NoReturn:
    """An exception of the user's code (or a bug) ended this worker: its traceback goes to
    RUN_DIR/logs/rank-R.traceback, the console gets one line naming the exception and the file (the
    launcher's last line names them too), and the worker exits 1. A lone process (python train.py) shows
    the traceback as Python does, and keeps the file as well."""
    if not tell_exception(err, env, run_dir):
        raise err
    sys.exit(1)


def tell_exception(err: BaseException, env: DistEnv, run_dir: str | None) -> bool:
    """``report_exception``'s telling: the traceback file, the error file, and the one console line; False
    when the caller must show the traceback itself (a lone process, or no run directory to keep it in)."""
    path = write_traceback(run_dir, env.rank, err)
    line = f"[rank {env.rank}] {type(err).__name__}: {_first_line(err)}"
    record_failure(env.error_file, "cause", line, err, traceback=path)
    if not env.is_distributed or path is None:
        return False
    say(f"ringtrain: error: {line} (traceback: {path})")
    return True


def uncaught_reporter(env: DistEnv, run_dir: Callable[[], str | None]) -> Callable[..., None]:
    """A ``sys.excepthook`` for a loop ringtrain does not run itself (a ``Session`` in the user's script): an
    exception that leaves the script is told as ``fit`` tells it (``report_error``, ``report_exception``:
    one line, the traceback in RUN_DIR/logs/rank-R.traceback, the launcher's last line naming it); the
    process then exits 1 as Python's own hook has it. Ctrl-C and the like go to Python's hook."""

    def hook(kind: type[BaseException], err: BaseException, trace: Any) -> None:
        if isinstance(err, RingtrainError):
            report_error(err, env)
        elif not isinstance(err, Exception) or not tell_exception(err, env, run_dir()):
            sys.__excepthook__(kind, err, trace)

    return hook


def say(line: str) -> None:
    """One line on stderr in one write: workers run unbuffered (``python -u``) into one pipe, where print()'s
    separate write of the newline lets another rank's line land inside this one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


if __name__ == "__main__":
    main()
    exit_quickly(0)  # errors leave through sys.exit above, with the interpreter's usual teardown
