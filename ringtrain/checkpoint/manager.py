"""CheckpointManager: verified, atomic saves; keep-last-K; loads that never unpickle arbitrary objects.

A checkpoint is whatever ``state_dict()``s the trainer hands over; the manager knows nothing of the
trainer. A save writes ``step_XXXXXXXX.pt`` atomically (temp file, fsync, rename, fsync the folder, itself
fsynced in its parent when created), then its sha256 manifest, the commit marker (``manifest.py``). A crash
at any moment leaves the previous checkpoints intact and the new one either committed or visibly uncommitted.

Loading checks the manifest first (the file opened as a regular file, its size compared before reading), then
bounds the pickle (``decode_limits``: nesting, size, memo slots; a hostile one would crash the process before
any exception), then unpickles with ``weights_only=True``: tensors and plain containers only (ringtrain stores
nothing else, so its allow-list adds no classes). There is no fallback to unsafe loading. Asked for "the latest", the manager skips broken newer checkpoints with a warning that
names each one and the checkpoint used instead.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ringtrain.checkpoint.manifest import (
    HashingWriter,
    make_dirs,
    manifest_path,
    read_manifest,
    read_verified,
    write_atomic,
    write_manifest,
)
from ringtrain.decode_limits import Refused, load_weights_only
from ringtrain.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint
from ringtrain.testing import faults

__all__ = ["CheckpointManager", "ALLOWED_GLOBALS", "load_checkpoint_file"]

_NAME = re.compile(r"^step_(\d{8})\.pt$")
_TEMP = re.compile(r"^\.step_\d{8}\.(pt|manifest\.json)\.tmp-(\d+)$")

ALLOWED_GLOBALS: tuple = ()
"""Classes beyond torch's weights-only defaults that a ringtrain checkpoint may hold: none. Everything
ringtrain saves is tensors, numbers, strings and containers; add a class here only if ringtrain stores it."""


class CheckpointManager:
    """Saves (writer rank only) and finds checkpoints ``step_XXXXXXXX.pt`` in one folder.

    Every rank makes one; only the writer writes, every rank can load::

        checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=3, is_writer=rank == 0)
        checkpoints.save(step, {"model": module.state_dict(), "sampler": sampler.state_dict()})
        found = checkpoints.load_latest()        # (path, state) of the newest that verifies, or None
        if found is not None:
            path, state = found
            module.load_state_dict(state["model"])
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, is_writer: bool = True,
                 fence: Callable[[], None] | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.is_writer = is_writer
        self.fence = fence
        """Called right before each file of a save takes its name (under --heal: raises if this writer was cut off
        from the job while it wrote, so a stopped writer that resumes commits nothing over the new writer's)."""

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def checkpoints(self) -> list[Path]:
        """Checkpoint data files, committed or not, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=_step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint file, without verifying it."""
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any], **manifest_fields: Any) -> Path | None:
        """Write ``state`` as the checkpoint of ``step`` and commit it (writer rank only; others: None)."""
        faults.point("checkpoint.save.enter", step=step)
        if not self.is_writer:
            return None
        make_dirs(self.directory)
        final = self.path_for(step)
        # Uncommit first: a crash while the new data replaces an old file of the same step must not leave
        # the old manifest vouching for the new bytes.
        if self.fence is not None:
            self.fence()
        manifest_path(final).unlink(missing_ok=True)
        digest = write_atomic(final, lambda f: _save_hashed(state, f), self.fence)
        faults.point("checkpoint.save.commit", step=step)
        write_manifest(final, digest, self.fence, step=step, **manifest_fields)
        self._prune()
        return final

    def verify(self, path: str | Path) -> None:
        """Raise CorruptCheckpoint unless ``path`` matches its manifest (size, then sha256); nothing unpickled."""
        read_verified(Path(path))

    def load(self, path: str | Path) -> dict[str, Any]:
        """Verify ``path`` against its manifest, then unpickle it weights-only."""
        return load_checkpoint_file(Path(path))

    def load_latest(self, warn: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies, and its state; ``warn`` hears about each broken newer one
        (by default a ``ringtrain: warning: ...`` line on stderr)."""
        warn = warn or _warn
        skipped: list[str] = []
        for path in reversed(self.checkpoints()):
            try:
                state = self.load(path)
            except CorruptCheckpoint as err:
                skipped.append(str(err))
                continue
            for reason in skipped:
                warn(f"{reason}; skipping it and resuming from {path.name}")
            return path, state
        for reason in skipped:
            warn(f"{reason}; skipping it (no older valid checkpoint)")
        return None

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` committed checkpoints; drop older files and stale temp files."""
        committed = [p for p in self.checkpoints() if manifest_path(p).exists()]
        if len(committed) > self.keep_last:
            oldest_kept = _step_of(committed[-self.keep_last])
            for old in self.checkpoints():
                if _step_of(old) < oldest_kept:
                    # Manifest first: a crash in between leaves an uncommitted file, never a false commit.
                    manifest_path(old).unlink(missing_ok=True)
                    old.unlink(missing_ok=True)
        # This writer is between saves: its own temp files are leftovers, and so are those of a process that is
        # gone. A live one's are another writer's save in progress (a writer that took over from this one).
        for leftover in self.directory.iterdir():
            found = _TEMP.match(leftover.name)
            if found and (int(found.group(2)) == os.getpid() or not _pid_alive(int(found.group(2)))):
                leftover.unlink(missing_ok=True)


def load_checkpoint_file(path: Path) -> dict[str, Any]:
    """Verify ``path`` against its manifest and unpickle it weights-only; errors name the file."""
    if not path.is_file() and not manifest_path(path).is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    payload = read_verified(path)
    try:
        # Bounded first (nesting, size, memo: decode_limits), then torch's weights-only unpickler.
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            state = load_weights_only(payload)
    except Refused as err:
        raise refused_pickle(err, f"checkpoint {path}") from None
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(
            f"checkpoint {path} holds {forbidden_global(err)}, which ringtrain never stores; refusing to "
            "unpickle it (it was not written by ringtrain, or it was tampered with)"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises several types for files that are not checkpoints
        raise CorruptCheckpoint(f"checkpoint {path} matches its manifest but cannot be read ({type(err).__name__})") from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"checkpoint {path} does not hold a state dictionary")
    return state


def checkpoint_step(path: Path) -> int | None:
    """The step recorded in ``path``'s manifest (None when it has none)."""
    try:
        return int(read_manifest(path)["step"])
    except (CorruptCheckpoint, KeyError, TypeError, ValueError):
        return None


def _warn(message: str) -> None:
    print(f"ringtrain: warning: {message}", file=sys.stderr, flush=True)


def _save_hashed(state: dict[str, Any], f) -> Any:
    writer = HashingWriter(f)
    torch.save(state, writer)
    return writer.digest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def refused_pickle(err: Refused, where: str) -> CheckpointError:
    """``decode_limits``' refusal of ``where``'s pickle as one line: CorruptCheckpoint for bytes that are no
    torch.save at all, UnsafeCheckpoint for a well-formed pickle past the bounds (planted: never skipped)."""
    if err.corrupt:
        return CorruptCheckpoint(f"{where} matches its manifest but cannot be read: it {err}")
    return UnsafeCheckpoint(f"{where} {err}; refused before unpickling anything (ringtrain never writes such a "
                            "pickle: not written by ringtrain, or tampered with)")


def forbidden_global(err: Exception) -> str:
    """What torch's weights-only unpickler refused, in a few words (its own message runs to many lines)."""
    match = re.search(r"GLOBAL ([\w.]+)", str(err))
    return f"a pickled reference to {match.group(1)}" if match else "pickle instructions outside the weights-only subset"
