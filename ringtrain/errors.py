"""Errors a user can fix.

Anything raised as a ``RingtrainError`` reaches the user as one line (``ringtrain: error: ...``) and exit
code 2, never as a traceback: its message must name the problem and the fix.
"""

from __future__ import annotations

__all__ = [
    "RingtrainError",
    "ConfigError",
    "CheckpointError",
    "CorruptCheckpoint",
    "UnsafeCheckpoint",
    "LaunchError",
]


class RingtrainError(Exception):
    """An error caused by the user's input; its message names the problem and the fix."""

    exit_code = 2


class ConfigError(RingtrainError):
    """A config file, override or flag is invalid."""


class CheckpointError(RingtrainError):
    """A checkpoint is missing, corrupt or does not match the run."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint fails its integrity check (truncated, altered, or never committed by a manifest).

    An older valid checkpoint may stand in for it when the caller asked for "the latest".
    """


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint's integrity is fine but it holds pickled objects ringtrain never stores.

    Never skipped in silence and never loaded unsafely: someone must look at it.
    """


class LaunchError(RingtrainError):
    """Workers could not be started (bad endpoint, busy port, ...)."""
