"""Process lifetime: a worker dies with the agent that started it, and leaves quickly when it is done.

An agent killed outright (SIGKILL, its host's OOM killer) cannot stop its workers; an orphaned worker
would go on training against a group that has moved on, or hold a GPU. On Linux the kernel delivers
SIGKILL to the worker when its parent goes; elsewhere this is a no-op.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading

__all__ = ["exit_with_parent", "exit_quickly", "finish_process", "STOP_SIGNALS"]

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP})
"""Signals that tell a job to stop or save (SLURM's warning, scancel, a shell's ``kill -TERM -PGID``, a lost
terminal): sent to every process of a job step, they are for the launcher and the workers. The forkserver that
workers fork from (launch.py) starts with them blocked, so it is not stopped before the workers it parents
(whose parent's death kills them: ``exit_with_parent``); a forked worker unblocks them first thing."""

_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent may have gone before the request took effect.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def exit_quickly(code: int = 0) -> None:
    """End a worker that finished its work: the interpreter's own teardown of a process that has imported
    torch (and torch._dynamo, which DDP imports) takes most of a second of CPU per worker and does nothing
    a finished worker needs. What it would do that matters is done first (``finish_process``); only then the
    process exits without the module teardown."""
    finish_process()
    os._exit(code)


def finish_process() -> None:
    """What a process's exit must still do when it skips the interpreter's teardown (``exit_quickly``, or a
    worker forked from the launcher's forkserver, which multiprocessing ends with ``os._exit``): non-daemon
    threads are joined, the atexit handlers run (logging's flush, weakref finalizers such as shared-memory
    cleanup), stdout and stderr are flushed."""
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
