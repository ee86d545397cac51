"""CheckpointManager: atomic saves, keep-last-K, safe loads.

A checkpoint is whatever ``state_dict()``s the trainer hands over; the manager knows nothing of the
trainer. A save is atomic: write a temp file in the same folder, fsync it, rename it into place, fsync
the folder. A crash at any moment leaves either the previous set of checkpoints or the new one, never a
half-written file under a checkpoint's name. Loading never unpickles arbitrary objects
(``weights_only=True``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ringtrain.errors import CheckpointError

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointManager:
    """Saves (writer rank only) and finds checkpoints ``step_XXXXXXXX.pt`` in one folder."""

    def __init__(self, directory: str | Path, keep_last: int = 3, is_writer: bool = True):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.is_writer = is_writer

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def checkpoints(self) -> list[Path]:
        """Existing checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``state`` as the checkpoint of ``step`` (on the writer rank; others return None)."""
        if not self.is_writer:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            with temp.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
            _fsync_dir(self.directory)
        finally:
            temp.unlink(missing_ok=True)
        self._prune()
        return final

    def load(self, path: str | Path) -> dict[str, Any]:
        """Read a checkpoint with ``weights_only=True``; a bad file is a CheckpointError naming it."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} not found")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for truncated or foreign files
            raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}); it is corrupt") from None

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last]:
            old.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the folder's entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
