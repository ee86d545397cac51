"""Run one training job inside an initialised process group; check a run directory before that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import read_verified
from ringtrain.config import Config
from ringtrain.dist.group import DistContext
from ringtrain.dist.jobstore import connect_job_store
from ringtrain.dist.watch import Heartbeat
from ringtrain.errors import CheckpointError, ConfigError, CorruptCheckpoint
from ringtrain.train.build import build_trainer
from ringtrain.train.resume import ResumePlan

__all__ = ["check_run_dir", "check_resume", "run_training"]


def check_run_dir(config: Config, resume: bool) -> None:
    """Refuse to start a fresh run over a run directory that holds checkpoints: that would lose work."""
    if resume:
        return
    latest = _manager(config).latest()
    if latest is not None:
        raise ConfigError(
            f"run directory {config.run_dir} already holds checkpoints (latest {latest.name}); "
            "add --resume to continue it, or pass --run-dir NEW_DIR to start another run"
        )


def check_resume(config: Config, resume: bool, resume_from: str | None) -> None:
    """Everything about resuming a user can get wrong, checked before any worker starts."""
    if resume and resume_from:
        raise ConfigError("pass --resume (continue this run) or --resume-from PATH (start a new run from PATH), not both")
    if resume_from:
        path = Path(resume_from)
        if not path.is_file():
            raise CheckpointError(f"--resume-from {path}: no such checkpoint file")
        read_verified(path)  # CorruptCheckpoint names the file and what is wrong with it
        latest = _manager(config).latest()
        if latest is not None:
            raise ConfigError(
                f"--resume-from starts a new run, but {config.run_dir} already holds checkpoints (latest "
                f"{latest.name}); pass --run-dir NEW_DIR, or use --resume to continue {config.run_dir}"
            )
        return
    if not resume:
        check_run_dir(config, resume=False)
        return
    manager = _manager(config)
    problems = []
    for path in reversed(manager.checkpoints()):
        try:
            read_verified(path)
            return  # the workers start from this one (or warn about newer broken ones first)
        except CorruptCheckpoint as err:
            problems.append(str(err))
    found = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"--resume: no valid checkpoint in {manager.directory}{found}; run without --resume to start afresh")


def run_training(config: Config, ctx: DistContext, plan: ResumePlan) -> dict[str, Any]:
    """Build the trainer, continue from a checkpoint when the plan says so, train, return the summary."""
    job_store = connect_job_store(ctx.env, is_writer=ctx.rank == 0)
    trainer = build_trainer(config, ctx, job_store)
    # The heartbeat lets a failed collective name the rank that stopped responding.
    with Heartbeat(job_store, ctx.rank):
        trainer.resume(plan)
        return trainer.fit()


def _manager(config: Config) -> CheckpointManager:
    return CheckpointManager(Path(config.run_dir) / config.checkpoint.dir, is_writer=False)
