"""Run one training job inside an initialised process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import Config
from ringtrain.dist.group import DistContext
from ringtrain.errors import ConfigError
from ringtrain.train.build import build_trainer

__all__ = ["check_run_dir", "run_training"]


def check_run_dir(config: Config, resume: bool) -> None:
    """Refuse to start a fresh run over a run directory that holds checkpoints: that would lose work."""
    if resume:
        return
    directory = Path(config.run_dir) / config.checkpoint.dir
    latest = CheckpointManager(directory, is_writer=False).latest()
    if latest is not None:
        raise ConfigError(
            f"run directory {config.run_dir} already holds checkpoints (latest {latest.name}); "
            "add --resume to continue it, or pass --run-dir NEW_DIR to start another run"
        )


def run_training(config: Config, ctx: DistContext, resume: bool, resume_required: bool) -> dict[str, Any]:
    """Build the trainer, restore the latest checkpoint when resuming, train, return the summary."""
    trainer = build_trainer(config, ctx)
    if resume:
        trainer.resume(required=resume_required)
    return trainer.fit()
