"""The sha256 manifest: a checkpoint's commit marker and integrity record.

A checkpoint ``step_00000040.pt`` counts only once ``step_00000040.manifest.json`` exists next to it. The
manifest is written last, atomically, after the data file is on disk; it records the data file's size and
sha256. So a save interrupted at any moment leaves either no manifest (never committed) or a manifest
whose data file matches it; a file truncated or altered later no longer matches its manifest.

    make_dirs(folder)                                         # mkdir -p, each new folder fsynced in its parent
    write_atomic(path, lambda f: f.write(payload))            # temp, fsync, rename, fsync the folder
    write_manifest(data_path, Digest(sha256, size), step=40)
    payload = read_verified(data_path)                        # bytes, or CorruptCheckpoint naming the file

Every checkpoint file is opened as ``open_regular`` opens it: not through a symlink (``O_NOFOLLOW``), without
waiting on a FIFO (``O_NONBLOCK``), and refused unless it is a regular file (``fstat``), so a planted FIFO,
device or symlink to ``/dev/zero`` is one line (``UnsafeCheckpoint``) instead of a hang or a read until memory
runs out. Sizes are checked before reading: against the manifest for data files, against a bound for the
manifest itself; a manifest is JSON of bounded nesting with the fields a ringtrain save writes, or
``CorruptCheckpoint``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from ringtrain.decode_limits import Refused, check_json
from ringtrain.errors import CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["FORMAT", "Digest", "HashingWriter", "manifest_path", "write_atomic", "make_dirs", "fsync_dir", "write_manifest",
           "read_verified", "open_regular", "read_regular", "read_json", "MAX_MANIFEST_BYTES"]

FORMAT = "ringtrain-checkpoint/1"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (a sharded one lists every rank's files: about 100 bytes each)."""


@dataclass(frozen=True)
class Digest:
    sha256: str
    size: int


class HashingWriter:
    """A binary file wrapper that hashes and counts what goes through it (no second pass over the file)."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        self._hash = hashlib.sha256()
        self._size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._size += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()

    def digest(self) -> Digest:
        return Digest(self._hash.hexdigest(), self._size)


def manifest_path(data_path: Path) -> Path:
    return data_path.with_name(data_path.name.removesuffix(".pt") + ".manifest.json")


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any], before_rename: Callable[[], None] | None = None) -> Any:
    """Write ``path`` so that it either appears whole or not at all; returns what ``write`` returned.
    ``before_rename`` runs last before the file takes its name (a writer's fence: it may raise to stop it)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temp.open("wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(temp, path)
        fsync_dir(path.parent)
    finally:
        temp.unlink(missing_ok=True)
    return result


def make_dirs(directory: Path) -> None:
    """``mkdir -p`` that survives a crash: each folder it creates is fsynced in its parent."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        # Files fsynced inside a folder are lost with it if the folder's own entry never reached the disk.
        fsync_dir(folder.parent)


def fsync_dir(directory: Path) -> None:
    # A rename is durable only once the folder's entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(data_path: Path, digest: Digest, before_rename: Callable[[], None] | None = None, **fields: Any) -> Path:
    """Commit ``data_path``: write its manifest (atomically) after the data file is durable."""
    manifest = {
        "format": FORMAT,
        "file": data_path.name,
        "bytes": digest.size,
        "sha256": digest.sha256,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **fields,
    }
    path = manifest_path(data_path)
    write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=2).encode() + b"\n"), before_rename)
    return path


def read_manifest(data_path: Path) -> dict[str, Any]:
    path = manifest_path(data_path)
    try:
        manifest = read_json(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {data_path} has no manifest {path.name} (a save that never finished?)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"checkpoint manifest {path} is not a {FORMAT} manifest")
    problem = file_entry_problem(manifest)
    if problem:
        raise CorruptCheckpoint(f"checkpoint manifest {path} {problem}")
    return manifest


def file_entry_problem(entry: Any) -> str | None:
    """What is wrong with a manifest's record of one file (``{"bytes": N, "sha256": HEX}``), or None."""
    if not isinstance(entry, dict):
        return f"records a file as a {type(entry).__name__}, not {{bytes, sha256}}"
    size, sha = entry.get("bytes"), entry.get("sha256")
    if type(size) is not int or size < 0:
        return f"has bytes {size!r}, not a whole number" if "bytes" in entry else "has no bytes"
    if type(sha) is not str or len(sha) != 64:
        return f"has sha256 {sha!r}, not 64 hex digits" if "sha256" in entry else "has no sha256"
    return None


def read_verified(data_path: Path) -> bytes:
    """The data file's bytes, checked against its manifest (size, before reading; then sha256)."""
    manifest = read_manifest(data_path)
    try:
        payload = read_regular(data_path, size=manifest["bytes"])
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {data_path} is missing (its manifest exists)") from None
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise CorruptCheckpoint(f"checkpoint {data_path} does not match the sha256 in its manifest (altered on disk)")
    return payload


# --- reading files that anyone who can write the folder may have planted ------------------------------------
def open_regular(path: Path) -> tuple[IO[bytes], int]:
    """``path`` opened for reading if it is a regular file, and its size; never through a symlink, never
    waiting on a FIFO. A symlink, FIFO, device, socket or folder is ``UnsafeCheckpoint`` (ringtrain writes
    none); a missing file is FileNotFoundError; another failure to open is ``CorruptCheckpoint``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        if os.path.islink(path):
            raise UnsafeCheckpoint(f"checkpoint file {path} is a symbolic link (to {os.readlink(path)}); ringtrain "
                                   "writes regular files only: refused without following it") from None
        if not os.path.isfile(path) and os.path.exists(path):
            raise UnsafeCheckpoint(f"checkpoint file {path} is not a regular file ({err.strerror}); refused") from None
        raise CorruptCheckpoint(f"checkpoint file {path} cannot be opened ({err.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device" if stat.S_ISCHR(info.st_mode) or
                    stat.S_ISBLK(info.st_mode) else "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file")
            raise UnsafeCheckpoint(f"checkpoint file {path} is {kind}; ringtrain writes regular files only: refused "
                                   "before reading it (planted, or not a checkpoint)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), its size checked before reading: exactly
    ``size`` (its manifest's: else ``CorruptCheckpoint``), at most ``limit`` (else ``UnsafeCheckpoint``)."""
    file, actual = open_regular(path)
    with file:
        if size is not None and actual != size:
            raise CorruptCheckpoint(f"checkpoint file {path} is {actual} bytes but its manifest says {size} (truncated?)")
        if limit is not None and actual > limit:
            raise UnsafeCheckpoint(f"checkpoint file {path} is {actual} bytes, more than the {limit} a ringtrain save "
                                   "writes there; refused before reading it")
        data = file.read(actual)
    if len(data) != actual:
        raise CorruptCheckpoint(f"checkpoint file {path} changed while it was read ({len(data)} of {actual} bytes)")
    return data


def read_json(path: Path, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """A checkpoint's JSON file (a manifest): a regular file of at most ``limit`` bytes, of bounded nesting,
    parsed; ``CorruptCheckpoint`` (one line) for anything that is not. FileNotFoundError passes."""
    data = read_regular(path, limit=limit)
    try:
        check_json(data)
        return json.loads(data.decode("utf-8"))
    except Refused as err:
        raise UnsafeCheckpoint(f"checkpoint manifest {path} {err}; refused before parsing it") from None
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError both are
        raise CorruptCheckpoint(f"checkpoint manifest {path} is unreadable ({str(err).splitlines()[0]})") from None
