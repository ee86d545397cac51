"""The job's secret, and the stores bound to it: nothing a process outside the job writes is ever read.

A TCPStore takes ``set`` from anyone who reaches its port: any local user on loopback, any host that reaches
``--rdzv-endpoint``. torch's c10d rendezvous keeps its state in such a store as a pickle and unpickles whatever
it finds there (a planted pickle runs as the job's user). So every ringtrain job has a secret (``JobSecret``:
256 random bits made by the launcher, or the one the user shares between nodes) and every value the job's
processes write to a store is sealed with it (HMAC-SHA256 over the key and the value); a value read back is
opened first and refused, in one line naming the store and the key, when its seal does not match. The stores:

- the rendezvous store (torch's c10d rendezvous state, its rank assignment, ringtrain's job store and the heal's
  membership, which all live in it): group/rendezvous.py is torch's dynamic rendezvous over an ``AuthStore``
  (group/auth_store.py); a tampered rendezvous state is written over with the agent's last good one;
- the workers' store (rank 0's, where Gloo's ranks exchange their addresses): an ``AuthStore`` (group/init.py).

This module needs no torch (the launcher's checks and ``ringtrain join`` read the secret before importing it).

Counters (``add``) cannot be sealed: a stranger can move one (a flight-recorder dump request, a restart count
read as a number), never make the job read a value it did not write. The secret travels in the environment
(``RINGTRAIN_JOB_SECRET``, readable by the job's own user only, in /proc) or a file of the user's own, mode 0600
(``RINGTRAIN_JOB_SECRET_FILE``): never on a command line, never in a file others can read.

    secret = JobSecret.new()
    sealed = secret.seal("key", b"value"); secret.open("key", sealed, where="the job store")  # -> b"value"
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ringtrain.errors import RingtrainError

__all__ = ["JobSecret", "UnsealedValue", "SecretError", "SECRET_VAR", "SECRET_FILE_VAR", "load_job_secret",
           "ensure_job_secret", "SECRET_BYTES", "secret_store_dir", "save_job_secret", "saved_job_secret",
           "forget_job_secret"]

SECRET_VAR = "RINGTRAIN_JOB_SECRET"
"""The job's secret as hex (at least 32 digits: 128 bits). The launcher makes one when none is given."""
SECRET_FILE_VAR = "RINGTRAIN_JOB_SECRET_FILE"
"""A file of the user's own (mode 0600, a regular file, not a link) holding the secret as hex."""
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
_SEAL = b"rt1"
"""The first bytes of every sealed value (the format's version), then the 32-byte tag, then the value."""
_TAG_BYTES = 32

log = logging.getLogger(__name__)


class SecretError(RingtrainError):
    """The secret named by the environment cannot be used; the message says why and how to fix it."""


class UnsealedValue(RuntimeError):
    """A store holds a value the job did not write (no seal, or a seal made without the job's secret).

    A RuntimeError, as a lost store connection is: every caller that survives the one survives the other."""


class JobSecret:
    """The job's secret key: seals store values and job files, and names the job's run id."""

    def __init__(self, key: bytes):
        if len(key) < MIN_SECRET_BYTES:
            raise SecretError(f"the job secret has {len(key) * 8} bits; give at least {MIN_SECRET_BYTES * 8} "
                              f"(e.g. {SECRET_VAR}=$(openssl rand -hex {SECRET_BYTES}))")
        self._key = key

    @classmethod
    def new(cls) -> JobSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, source: str = SECRET_VAR) -> JobSecret:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise SecretError(f"{source} is not a hex string (make one with: openssl rand -hex {SECRET_BYTES})") from None

    @property
    def hex(self) -> str:
        return self._key.hex()

    def tag(self, name: str, value: bytes) -> bytes:
        """HMAC-SHA256 of ``value`` under ``name`` (a store key, a file's role): a value is valid for its key only."""
        return hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def seal(self, name: str, value: bytes) -> bytes:
        return _SEAL + self.tag(name, value) + value

    def open(self, name: str, sealed: bytes, where: str) -> bytes:
        """The value inside ``sealed``, or UnsealedValue naming ``where`` and ``name``."""
        head, tag, value = sealed[:len(_SEAL)], sealed[len(_SEAL):len(_SEAL) + _TAG_BYTES], sealed[len(_SEAL) + _TAG_BYTES:]
        if head != _SEAL or len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, self.tag(name, value)):
            raise UnsealedValue(f"{where}: key {name!r} holds a value not sealed with this job's secret (written by a "
                                "process outside the job); refused, nothing of it was read")
        return value

    def derive(self, purpose: str, text: str = "") -> str:
        """A name only the job can compute (its run id): hex of the tag of ``text`` under ``purpose``."""
        return self.tag(f"derive/{purpose}", text.encode()).hex()

    def __repr__(self) -> str:  # never print the key
        return "JobSecret(...)"


def load_job_secret(environ: Mapping[str, str]) -> JobSecret | None:
    """The secret the environment names (RINGTRAIN_JOB_SECRET, else RINGTRAIN_JOB_SECRET_FILE), or None."""
    if environ.get(SECRET_VAR):
        return JobSecret.from_hex(environ[SECRET_VAR])
    path = environ.get(SECRET_FILE_VAR)
    if not path:
        return None
    return JobSecret.from_hex(_read_private_file(Path(path)), f"{SECRET_FILE_VAR} ({path})")


def ensure_job_secret(environ: MutableMapping[str, str]) -> JobSecret:
    """The launcher's: the secret the user gave, else a new one; either way in ``environ`` as hex, so the
    agents and workers this process starts inherit it (and nothing else sees it)."""
    secret = load_job_secret(environ) or JobSecret.new()
    environ[SECRET_VAR] = secret.hex
    return secret


def _read_private_file(path: Path) -> str:
    """A small regular file of this user's own that no one else can read or write, opened without following a
    link; else SecretError naming the fix."""
    fix = f"(chmod 600 {path}, owned by you; a regular file, not a link)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise SecretError(f"{SECRET_FILE_VAR} {path}: cannot open it ({err.strerror}) {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{SECRET_FILE_VAR} {path} is not a regular file {fix}")
        if info.st_uid != os.geteuid():
            raise SecretError(f"{SECRET_FILE_VAR} {path} belongs to uid {info.st_uid}, not to you {fix}")
        if info.st_mode & 0o077:
            raise SecretError(f"{SECRET_FILE_VAR} {path} has mode {stat.S_IMODE(info.st_mode):o}: others may read or "
                              f"write it {fix}")
        if info.st_size > 4096:
            raise SecretError(f"{SECRET_FILE_VAR} {path} is {info.st_size} bytes; a secret is one hex line")
        return os.read(fd, 4096).decode("ascii", errors="replace")
    finally:
        os.close(fd)


def secret_store_dir() -> Path:
    """Where a launcher keeps the secret of a job that ``ringtrain join`` may join later: ~/.ringtrain/jobs (0700)."""
    return Path.home() / ".ringtrain" / "jobs"


def save_job_secret(secret: JobSecret, run_id: str) -> Path:
    """Keep ``secret`` for ``ringtrain join`` of this job from the same account (0600 in a 0700 folder)."""
    folder = secret_store_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = folder / f"{run_id}.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secret.hex + "\n").encode())
    finally:
        os.close(fd)
    return path


def saved_job_secret(run_id: str) -> JobSecret | None:
    """The secret a launcher of this account kept for ``run_id`` (save_job_secret), or None."""
    path = secret_store_dir() / f"{run_id}.secret"
    if not path.is_file() or path.is_symlink():
        return None
    return JobSecret.from_hex(_read_private_file(path), str(path))


def forget_job_secret(run_id: str) -> None:
    try:
        (secret_store_dir() / f"{run_id}.secret").unlink()
    except OSError:
        pass
