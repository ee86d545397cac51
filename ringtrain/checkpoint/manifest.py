"""The sha256 manifest: a checkpoint's commit marker and integrity record.

A checkpoint ``step_00000040.pt`` counts only once ``step_00000040.manifest.json`` exists next to it. The
manifest is written last, atomically, after the data file is on disk; it records the data file's size and
sha256. So a save interrupted at any moment leaves either no manifest (never committed) or a manifest
whose data file matches it; a file truncated or altered later no longer matches its manifest.

    make_dirs(folder)                                         # mkdir -p, each new folder fsynced in its parent
    write_atomic(path, lambda f: f.write(payload))            # temp, fsync, rename, fsync the folder
    write_manifest(data_path, Digest(sha256, size), step=40)
    payload = read_verified(data_path)                        # bytes, or CorruptCheckpoint naming the file
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from ringtrain.errors import CorruptCheckpoint

__all__ = ["FORMAT", "Digest", "HashingWriter", "manifest_path", "write_atomic", "make_dirs", "fsync_dir", "write_manifest",
           "read_verified"]

FORMAT = "ringtrain-checkpoint/1"


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
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {data_path} has no manifest {path.name} (a save that never finished?)") from None
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"checkpoint manifest {path} is unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"checkpoint manifest {path} is not a {FORMAT} manifest")
    return manifest


def read_verified(data_path: Path) -> bytes:
    """The data file's bytes, checked against its manifest (size, then sha256)."""
    manifest = read_manifest(data_path)
    try:
        payload = data_path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {data_path} is missing (its manifest exists)") from None
    if len(payload) != manifest["bytes"]:
        raise CorruptCheckpoint(
            f"checkpoint {data_path} is {len(payload)} bytes but its manifest says {manifest['bytes']} (truncated?)"
        )
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise CorruptCheckpoint(f"checkpoint {data_path} does not match the sha256 in its manifest (altered on disk)")
    return payload
