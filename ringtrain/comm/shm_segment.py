"""POSIX shared-memory segments that cannot outlive the job.

A segment is created by one rank, opened by the others of its host, and unlinked (its name removed from
``/dev/shm``) as soon as every rank has it mapped. From then on the memory lives exactly as long as some
process maps it: a normal exit, an exception, SIGKILL of every rank, nothing leaves a file behind. The only
window where a name exists is set-up; a segment left by a set-up that crashed is removed by the next one
(``sweep_stale``). The creator holds an exclusive ``flock`` on the file while its name exists, and the kernel
drops it when the creator dies, however it dies: a segment nobody locks is orphaned. Unlike the creator's
pid, a lock means the same in every container that shares ``/dev/shm``, whatever its pid namespace.

``/dev/shm`` is shared with every local user, who may plant anything under a ``ringtrain-`` name: a file of
theirs, a symlink, a FIFO. Nothing here follows a symlink (``O_NOFOLLOW``), blocks on a FIFO (``O_NONBLOCK``)
or touches what is not a regular file owned by this process's uid (``fstat`` of the open file); a sweep skips
what it may not remove, and a name built from a peer's ``[pid, token]`` is checked first (``peer_segment_name``)::

    >>> seg = Segment.create(segment_name(), 1 << 20)      # on one rank; the others: Segment.attach(name)
    >>> seg.unlink()                                        # once all have attached
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import time
from stat import S_ISREG

__all__ = ["Segment", "segment_name", "peer_segment_name", "sweep_stale", "sweep_dead", "unlink", "SHM_DIR", "PREFIX",
           "STALE_AFTER_S"]

SHM_DIR = "/dev/shm"
PREFIX = "ringtrain-"
STALE_AFTER_S = 10.0
"""An unlocked segment is swept only when older than this: between creating the file and locking it, a
creator holds no lock for a few microseconds."""


def segment_name(creator_pid: int | None = None, token: str | None = None) -> str:
    """``ringtrain-<creator pid>-<random>``: the pid tells a person who made it (``sweep_stale`` asks the lock)."""
    return f"{PREFIX}{creator_pid or os.getpid()}-{token or secrets.token_hex(6)}"


MAX_PID = 1 << 22
"""Linux's largest pid_max (``/proc/sys/kernel/pid_max`` is at most 2**22)."""
_TOKEN = re.compile(r"[0-9a-f]{12}")
"""A peer's token: ``os.urandom(6).hex()``."""
_SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")


def peer_segment_name(announced: object, suffix: str, rank: int) -> str:
    """The name of the segment that rank ``rank`` announced as ``[pid, token]`` (``shm_group.share_segment``),
    with this side's ``suffix`` (scope and purpose): a pid of 1 to 2**22 and a token of 12 lowercase hex
    digits, nothing else (no ``/``, no ``..``, no other user's name). Raises ValueError, one line naming the
    rank, for anything else."""
    pid, token = announced if isinstance(announced, list) and len(announced) == 2 else (None, None)
    if type(pid) is not int or not 0 < pid <= MAX_PID or not isinstance(token, str) or not _TOKEN.fullmatch(token):
        shown = repr(announced)
        raise ValueError(f"rank {rank} announced shm segment {shown[:80]}{'...' * (len(shown) > 80)}, not [pid, "
                         "12 hex digits]: not a ringtrain peer; refused")
    if not _SUFFIX.fullmatch(suffix):
        raise ValueError(f"shm segment suffix {suffix!r} is not 1 to 64 letters, digits, '-' or '_'")
    return segment_name(pid, f"{token}-{suffix}")


class Segment:
    """One mapped shared-memory file of ``/dev/shm``."""

    def __init__(self, name: str, size: int, buf: mmap.mmap, lock_fd: int | None = None):
        self.name = name
        self.size = size
        self.buf = buf
        self._lock_fd = lock_fd
        """The creator's open file, holding the flock that marks the named segment as in use."""

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create and map ``name`` with ``size`` bytes reserved now (no SIGBUS later on a full /dev/shm)."""
        _check_shm_dir()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Held until unlink(): while it is, no sweeper takes the segment for orphaned. (Blocking: a sweeper
            # that tried the lock in the microseconds since the open lets go at once, the file being new.)
            fcntl.flock(fd, fcntl.LOCK_EX)
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
            return cls(name, size, mmap.mmap(fd, size), lock_fd=fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map the existing segment ``name`` (created by another rank of this host, as this uid): a regular
        file owned by this process's uid, never through a symlink; OSError otherwise."""
        fd = _open_own(name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            return cls(name, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name, then let go of the lock; the memory stays mapped for whoever has it. Idempotent."""
        unlink(self.name)
        self._release_lock()

    def close(self) -> None:
        """Unmap, unless tensors still point into the memory (then it goes when they do)."""
        self._release_lock()
        try:
            self.buf.close()
        except BufferError:
            pass

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def unlink(name: str) -> None:
    """Remove ``name`` from /dev/shm if it is there and this uid may (another user's file in the sticky
    /dev/shm is left where it is)."""
    try:
        os.unlink(_path(name))
    except (FileNotFoundError, PermissionError):
        pass


def sweep_stale() -> list[str]:
    """Remove ringtrain segments that no live process holds (no creator's lock) and that are older than
    ``STALE_AFTER_S``; return their names. Only regular files of this uid: another user's file (or a symlink,
    a FIFO) under a ringtrain name is skipped, never a reason to fail."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            fd = _open_own(name, os.O_RDONLY)
        except OSError:  # gone meanwhile, or not ours (another uid's, a symlink, a FIFO)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if now - os.fstat(fd).st_mtime > STALE_AFTER_S:
                os.unlink(_path(name))  # under the lock: a creator cannot take it meanwhile
                removed.append(name)
        except OSError:  # locked: its creator is alive (in this pid namespace or another); or not ours to remove
            pass
        finally:
            os.close(fd)
    return removed


def sweep_dead(pids: list[int]) -> list[str]:
    """Remove at once the segments that these processes, known dead (peers of this host that a failed
    collective lost), created and left named: a set-up they died in. Unlike ``sweep_stale`` no age is
    needed, since a dead creator never takes its lock; a segment whose lock is held (its pid reused by a
    live creator) is kept. Returns their names."""
    removed = []
    dead = [pid for pid in pids if not _alive(pid)]
    if not dead:
        return removed
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not any(name.startswith(f"{PREFIX}{pid}-") for pid in dead):
            continue
        try:
            fd = _open_own(name, os.O_RDONLY)
        except OSError:  # gone, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(_path(name))
            removed.append(name)
        except OSError:  # held: a live process with that pid created it (or not ours to remove)
            pass
        finally:
            os.close(fd)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs here (a zombie, killed but not yet reaped, is dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _open_own(name: str, flags: int) -> int:
    """Open ``name`` of /dev/shm if it is a regular file owned by this process's uid: never through a symlink
    (O_NOFOLLOW), never blocking on a FIFO (O_NONBLOCK); checked on the open file (fstat), so what was checked
    is what is used. OSError (with a strerror saying why) otherwise."""
    try:
        fd = os.open(_path(name), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, refused (another user's?)", _path(name)) from None
        raise
    info = os.fstat(fd)
    if not S_ISREG(info.st_mode):
        why = "not a regular file; refused"
    elif info.st_uid != os.geteuid():
        why = f"owned by uid {info.st_uid}, not this process's uid {os.geteuid()}; refused"
    else:
        return fd
    os.close(fd)
    raise OSError(errno.EPERM, why, _path(name))


def _free_bytes() -> int:
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _check_shm_dir() -> None:
    if not os.path.isdir(SHM_DIR):
        raise OSError(errno.ENOENT, f"algorithm='shm' needs POSIX shared memory at {SHM_DIR} (Linux); use algorithm='ring'")
