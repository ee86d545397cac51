"""Checkpoints: atomic saves, keep-last-K, safe loads."""

from ringtrain.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
