"""Process lifetime: a worker dies with the agent that started it.

An agent killed outright (SIGKILL, its host's OOM killer) cannot stop its workers; an orphaned worker
would go on training against a group that has moved on, or hold a GPU. On Linux the kernel delivers
SIGKILL to the worker when its parent goes; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["exit_with_parent"]

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
