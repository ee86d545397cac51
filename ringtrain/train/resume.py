"""Which checkpoint a (re)started worker group continues from, and what the restart cost.

Every rank makes the same choice from the same files: the run's newest checkpoint that verifies (broken
newer ones are skipped with a warning), else the checkpoint named by ``--resume-from``, else a fresh start
(an error under ``--resume``). The ranks then compare the steps they picked, so a run directory that is
not shared by every host fails loudly instead of training from different states.

    plan = ResumePlan(required=True)
    found = pick_checkpoint(manager, plan, warn=print)      # (path, state) or None
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.comm.objects import all_gather_json
from ringtrain.config import Config
from ringtrain.group.jobstore import PreviousAttempt
from ringtrain.errors import CheckpointError

__all__ = ["ResumePlan", "pick_checkpoint", "check_same_choice", "config_changes", "resume_record"]


@dataclass(frozen=True)
class ResumePlan:
    """What the command line asked for."""

    resume: bool = False
    """Continue from a checkpoint when there is one (restarts, joins, --resume)."""
    required: bool = False
    """--resume: a valid checkpoint must exist."""
    source: Path | None = None
    """--resume-from: the checkpoint to start from while the run has none of its own."""

    @classmethod
    def fresh(cls) -> ResumePlan:
        return cls()


def pick_checkpoint(manager: CheckpointManager, plan: ResumePlan, warn) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to continue from and its state, or None to start fresh."""
    if not plan.resume:
        return None
    found = manager.load_latest(warn)
    if found is not None:
        # The run's own checkpoints win: after a restart they are newer than --resume-from's.
        return found
    if plan.source is not None:
        return plan.source, manager.load(plan.source)
    if plan.required:
        raise CheckpointError(
            f"--resume: no valid checkpoint in {manager.directory}; run without --resume to start afresh"
        )
    return None


def check_same_choice(step: int) -> None:
    """Fail unless every rank picked the checkpoint of the same step (one all_gather)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    steps = all_gather_json(step)
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"ranks picked checkpoints of different steps {steps}: every host must see the same run "
            "directory (a shared filesystem)"
        )


def config_changes(stored_toml: str, config: Config) -> list[str]:
    """'section.field: old -> new' for each field that differs from the checkpoint's config."""
    before = tomllib.loads(stored_toml)
    after = tomllib.loads(config.to_toml())
    for values in (before, after):
        values.pop("run_dir", None)  # the same run may move
    return list(_differences(before, after))


def resume_record(path: Path | None, step: int, world_size: int, previous: PreviousAttempt) -> dict[str, Any]:
    """The metrics record (and console line) of a resume; a restart also reports the steps it lost.
    ``path`` None: a restart before the first checkpoint, which starts over."""
    record: dict[str, Any] = {
        "type": "resume",
        "checkpoint": None if path is None else path.name,
        "step": step,
        "world_size": world_size,
        "restart": previous.starts - 1,
    }
    if previous.last_step is not None:
        record["steps_lost"] = max(0, previous.last_step - step)
        record["last_step_time"] = previous.last_step_time
    return record


def _differences(before: dict[str, Any], after: dict[str, Any], prefix: str = ""):
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) or isinstance(new, dict):
            yield from _differences(old or {}, new or {}, f"{prefix}{key}.")
        elif old != new:
            yield f"{prefix}{key}: {'unset' if old is None else old} -> {'unset' if new is None else new}"
