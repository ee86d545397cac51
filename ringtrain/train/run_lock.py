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
    by the kernel when the process dies) makes the second writer wait for the first, then fail naming it. A
    writer that finishes (without an error: a failed or fenced one leaves it, as a killed one does) removes the
    file as it lets go, so a finished run directory holds no ``.lock``; a waiter that then holds the lock of a
    removed file opens the path again (``_holds``), so two writers never hold two files.
    """

    def __init__(self, run_dir: str | Path, timeout_s: float = 60.0):
        self.path = Path(run_dir) / ".lock"
        self.timeout_s = timeout_s
        self.fd: int | None = None
        self.locked = False
        """Whether this process holds the lock (a take-over waits for it in a thread)."""

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._holds(fd):
                    break
                os.close(fd)  # the holder removed the file as it finished: lock the one at the path now
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        self.fd, self.locked = fd, True
        return self

    def take_over(self) -> RunDirLock:
        """A worker that became the writer of a --heal job: take the lock as soon as the previous writer's
        process is gone (a stopped writer that was cut off still holds it; the generation fences it meanwhile).
        Waits in a thread, so writing goes on at once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = fd

        def wait() -> None:
            nonlocal fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the old holder's process exits
                while not self._holds(fd):  # it finished and removed the file: lock the one at the path
                    os.close(fd)
                    fd = self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                self.locked = True
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
            except OSError:
                pass  # closed meanwhile: this worker finished first

        threading.Thread(target=wait, name="ringtrain-run-dir-lock", daemon=True).start()
        return self

    def _holds(self, fd: int) -> bool:
        """Whether ``fd`` (locked) is still the file at the path (a finishing holder removes it)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def __exit__(self, exc_type=None, *exc) -> None:
        if self.fd is not None:
            # Only a writer that finished removes it: one that failed, or was fenced (cut off by a heal, the run
            # directory another writer's now), leaves the directory as a killed one does.
            if exc_type is None and self.locked and self._holds(self.fd):
                self.path.unlink(missing_ok=True)  # removed while locked: a waiter sees it gone and opens anew
            os.close(self.fd)  # closing releases the lock
            self.fd, self.locked = None, False
