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

__all__ = ["exit_with_parent", "exit_quickly"]

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
    a finished worker needs. What it would do that matters is done here first: non-daemon threads are
    joined, the atexit handlers run (logging's flush, weakref finalizers such as shared-memory cleanup),
    stdout and stderr are flushed. Only then the process exits without the module teardown."""
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
    os._exit(code)
