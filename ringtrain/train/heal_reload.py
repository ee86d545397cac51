"""Healing a sharded strategy in place: the lost worker held the only copy of its shards, so the survivors
reload every shard from the newest sharded checkpoint, resharded to their new group, and go on from there.

zero1/zero2/zero3 (and fsdp) keep each stretch of the optimizer state (zero3: of the parameters too) on one
worker only: no survivor can hand it on, so the replicated heal's peer copy (train/heal.py) cannot work.
Instead, after the survivors regroup exactly as the replicated heal does (``Membership.agree``, a new Gloo
group), ``Healing.heal`` raises ``ShardsLost``; ``fit_with_reloads`` (around ``Trainer.fit`` in
train/run.py) catches it and, in the same processes:

1. every survivor picks the newest sharded checkpoint that verifies (the same on every rank: one all_gather);
   none yet: the job ends with one line (the shards are lost and nothing can be saved; a later
   ``--resume`` starts over, a lower ``checkpoint.every_steps`` shortens what a loss costs);
2. the writer's files are closed, and the trainer is built again at the new world size over the new group
   (``build_trainer``: the strategy shards the model and optimizer for the survivors, loaders and ledger for
   their ranks), as a restart would build it, but without a process restart or a rendezvous;
3. the checkpoint is loaded into the new layout (DCP reshards it, as ``--resume`` at another worker count
   does), which rewinds the model, optimizer, sampler, step and precision to the checkpoint's step; the
   writer's ledger is cut back to it when training starts, so every sample is still used exactly once;
4. the heal record (``type = "heal"``) reports ``steps_lost`` = the steps applied since that checkpoint,
   ``reloaded`` = its name; ``recovery_s`` still runs from the last step completed before the failure.

When fewer than ``--min-nproc`` workers remain, the survivors cannot save the step they reached (a shard is
gone): they exit with one line naming the last checkpoint, which ``--resume`` continues from.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringtrain.checkpoint.sharded import checkpoint_step_of
from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import verify as verify_sharded
from ringtrain.dist.group import DistContext, host_placement
from ringtrain.dist.heal import Generation, HealFailed, Membership
from ringtrain.errors import CorruptCheckpoint
from ringtrain.train.resume import check_same_choice
from ringtrain.train.sharded_state import load_sharded

if TYPE_CHECKING:
    from ringtrain.train.loop import Trainer

__all__ = ["ShardsLost", "shards_lost", "fit_with_reloads", "reload_shards", "newest_sharded_checkpoint"]

Rebuild = Callable[[DistContext, Membership], "Trainer"]
"""Builds the trainer again on the new group (train/run.py: ``build_trainer`` with the run's config and parts)."""


class ShardsLost(Exception):
    """Raised out of ``Trainer.fit`` by a heal of a sharded strategy, after the survivors regrouped: the
    trainer must be rebuilt and reloaded from the newest sharded checkpoint (``fit_with_reloads``)."""

    def __init__(self, record: dict[str, Any], applied_step: int, last_commit_s: float):
        super().__init__(f"step {record['step']}: shards lost with {record['lost_ranks']}")
        self.record = record
        self.applied_step = applied_step
        """The step this worker had applied when the failure came (steps after the checkpoint are lost)."""
        self.last_commit_s = last_commit_s
        """When the last step before the failure completed (recovery_s runs from there)."""


def shards_lost(trainer: Trainer, record: dict[str, Any], min_workers: int, last_commit_s: float) -> None:
    """``Healing.heal`` of a sharded strategy, once the survivors are in their new group: below
    ``min_workers`` end the job (nothing can be saved), else raise ``ShardsLost``."""
    world_size = record["world_size"]
    if world_size < min_workers:
        newest = newest_sharded_checkpoint(trainer.checkpoints.directory)
        since = f"continue from {newest.name} with --resume" if newest is not None else (
            "no sharded checkpoint was saved yet: --resume starts over (set a lower checkpoint.every_steps)")
        raise HealFailed(
            f"step {record['step']}: {_ranks(record['lost_ranks'])} lost and only {world_size} worker"
            f"{'s' * (world_size != 1)} remain, below --min-nproc {min_workers}; comm.strategy = "
            f"'{trainer.parts.strategy.name}' held shards only there, so this step cannot be saved: {since}"
        )
    raise ShardsLost(record, trainer.state.step, last_commit_s)


def fit_with_reloads(trainer: Trainer, rebuild: Rebuild) -> dict[str, Any]:
    """``trainer.fit()``, rebuilt and reloaded from the newest sharded checkpoint after every heal of a
    sharded strategy (``ShardsLost``); returns the summary of the trainer that finished."""
    while True:
        try:
            return trainer.fit()
        except ShardsLost as lost:
            old, trainer = trainer, reload_shards(trainer, lost, rebuild)
            _close(old)
        finally:
            if trainer.finished:
                _close(trainer)


def _close(trainer: Trainer) -> None:
    """End the threads of a trainer's strategy (zero3's communication thread): the Healing that points back
    at the trainer keeps it alive past the run, and a finished worker joins every thread it has."""
    close = getattr(trainer.parts.strategy, "close", None)
    if close is not None:
        close()


def reload_shards(old: Trainer, lost: ShardsLost, rebuild: Rebuild) -> Trainer:
    """The trainer rebuilt on the survivors' group, at the newest sharded checkpoint's state (see the module's
    docstring); the heal's record waits for its first completed step."""
    started = time.perf_counter()
    membership: Membership = old.healing.membership  # type: ignore[attr-defined]
    path = newest_sharded_checkpoint(old.checkpoints.directory)
    check_same_choice(-1 if path is None else checkpoint_step_of(path))
    record = lost.record
    if path is None:
        raise HealFailed(
            f"step {record['step']}: {_ranks(record['lost_ranks'])} lost, and comm.strategy = "
            f"'{old.parts.strategy.name}' held shards only there; no sharded checkpoint was saved yet, so there is "
            "nothing to reload and this step cannot be saved: --resume starts over (set a lower "
            "checkpoint.every_steps so that a lost worker costs fewer steps)"
        )
    old.parts.ledger.close()
    old.logger.close()
    ctx = generation_context(old.ctx, membership.generation)
    old.parts.job_store.is_writer = ctx.rank == 0  # rank 0 lost: this worker now counts the job's progress
    new = rebuild(ctx, membership)
    new.previous = old.previous
    assert new.sharded is not None  # checkpoint.sharded = true (the config refuses a sharded heal without it)
    extra = load_sharded(new.sharded, path, new.parts.strategy, new.model, new.parts.optimizer)
    new._load_checkpoint(path, extra)
    steps_lost = max(0, lost.applied_step - new.state.step)
    new.parts.job_store.add_steps_lost(steps_lost)  # the writer counts them for summary.json
    new.healing.pending = {**record, "from_step": new.state.step, "steps_lost": steps_lost, "reloaded": path.name,
                           "reload_s": round(time.perf_counter() - started, 3)}
    new.healing.last_commit_s = lost.last_commit_s
    if ctx.rank == 0:
        print(f"ringtrain: {_ranks(record['lost_ranks'])} held the only copy of its shards: {ctx.world_size} workers "
              f"reloaded {path.name} (step {new.state.step}); {steps_lost} steps since it are redone",
              file=sys.stderr, flush=True)
    return new


def newest_sharded_checkpoint(directory: Path) -> Path | None:
    """The newest committed sharded checkpoint that verifies (None: there is none)."""
    for path in reversed(committed_sharded(directory)):
        try:
            verify_sharded(path)
            return path
        except CorruptCheckpoint:
            continue
    return None


def generation_context(ctx: DistContext, generation: Generation) -> DistContext:
    """``ctx`` for this worker's rank and world size in ``generation``."""
    host_rank, host_world_size = host_placement(ctx.env.bind_addr)
    env = dataclasses.replace(ctx.env, rank=generation.rank, world_size=generation.world_size)
    return dataclasses.replace(ctx, env=env, host_rank=host_rank, host_world_size=host_world_size)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
