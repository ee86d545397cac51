"""Errors a user can fix.

Anything raised as a ``RingtrainError`` reaches the user as one line (``ringtrain: error: ...``) and exit
code 2, never as a traceback: its message must name the problem and the fix.
"""

from __future__ import annotations

__all__ = ["RingtrainError", "ConfigError", "CheckpointError", "LaunchError"]


class RingtrainError(Exception):
    """An error caused by the user's input; its message names the problem and the fix."""

    exit_code = 2


class ConfigError(RingtrainError):
    """A config file, override or flag is invalid."""


class CheckpointError(RingtrainError):
    """A checkpoint is missing, corrupt or does not match the run."""


class LaunchError(RingtrainError):
    """Workers could not be started (bad endpoint, busy port, ...)."""
