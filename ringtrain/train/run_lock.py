"""The writer's exclusive lock on a run directory: one group writes a run directory at a time."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from ringtrain.errors import ConfigError

__all__ = ["RunDirLock"]


class RunDirLock:
    """The writer's exclusive lock on a run directory, held while it trains.

    Two groups writing one run directory would interleave checkpoints and ledgers: a user starting the
    same run twice, or an elastic job split in two by a badly tuned rendezvous. The lock (flock, released
    by the kernel when the process dies) makes the second writer wait for the first, then fail naming it.
    """

    def __init__(self, run_dir: str | Path, timeout_s: float = 60.0):
        self.path = Path(run_dir) / ".lock"
        self.timeout_s = timeout_s
        self.fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise ConfigError(
                        f"run directory {self.path.parent} is in use by another training process ({holder}) since "
                        f"{self.timeout_s:g} s; two jobs must not share a run directory: pass --run-dir NEW_DIR"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self.fd = fd
        return self

    def take_over(self) -> RunDirLock:
        """A worker that became the writer of a --heal job: take the lock as soon as the previous writer's
        process is gone (a stopped writer that was cut off still holds it; the generation fences it meanwhile).
        Waits in a thread, so writing goes on at once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = fd

        def wait() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the old holder's process exits
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
            except OSError:
                pass  # closed meanwhile: this worker finished first

        threading.Thread(target=wait, name="ringtrain-run-dir-lock", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
