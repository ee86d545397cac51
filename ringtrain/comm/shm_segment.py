"""POSIX shared-memory segments that cannot outlive the job.

A segment is created by one rank, opened by the others of its host, and unlinked (its name removed from
``/dev/shm``) as soon as every rank has it mapped. From then on the memory lives exactly as long as some
process maps it: a normal exit, an exception, SIGKILL of every rank, nothing leaves a file behind. The only
window where a name exists is set-up; a segment left by a set-up that crashed is removed by the next one
(``sweep_stale``: its name carries the creator's pid)::

    >>> seg = Segment.create(segment_name(), 1 << 20)      # on one rank; the others: Segment.attach(name)
    >>> seg.unlink()                                        # once all have attached
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets

__all__ = ["Segment", "segment_name", "sweep_stale", "SHM_DIR", "PREFIX"]

SHM_DIR = "/dev/shm"
PREFIX = "ringtrain-"


def segment_name(creator_pid: int | None = None, token: str | None = None) -> str:
    """``ringtrain-<creator pid>-<random>``: the pid lets ``sweep_stale`` know when it is orphaned."""
    return f"{PREFIX}{creator_pid or os.getpid()}-{token or secrets.token_hex(6)}"


class Segment:
    """One mapped shared-memory file of ``/dev/shm``."""

    def __init__(self, name: str, size: int, buf: mmap.mmap):
        self.name = name
        self.size = size
        self.buf = buf

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create and map ``name`` with ``size`` bytes reserved now (no SIGBUS later on a full /dev/shm)."""
        _check_shm_dir()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                # Reserve the pages now: a sparse file on a full tmpfs would SIGBUS on first touch instead.
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                os.unlink(_path(name))
                if err.errno in (errno.ENOSPC, errno.EFBIG):
                    free_mb = _free_bytes() / 2**20
                    raise OSError(
                        err.errno,
                        f"shared memory is full: {size / 2**20:.1f} MB needed in {SHM_DIR}, {free_mb:.1f} MB free; "
                        "enlarge it (docker run --shm-size=1g) or use algorithm='ring'",
                    ) from None
                raise
            return cls(name, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map the existing segment ``name`` (created by another rank of this host)."""
        fd = os.open(_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            return cls(name, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name; the memory stays mapped for whoever has it. Idempotent across ranks."""
        unlink(self.name)

    def close(self) -> None:
        """Unmap, unless tensors still point into the memory (then it goes when they do)."""
        try:
            self.buf.close()
        except BufferError:
            pass


def unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def sweep_stale() -> list[str]:
    """Remove ringtrain segments whose creating process is gone; return their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_exists(int(pid_text)):
            unlink(name)
            removed.append(name)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _free_bytes() -> int:
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _check_shm_dir() -> None:
    if not os.path.isdir(SHM_DIR):
        raise OSError(errno.ENOENT, f"algorithm='shm' needs POSIX shared memory at {SHM_DIR} (Linux); use algorithm='ring'")
