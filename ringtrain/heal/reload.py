"""Healing a sharded strategy: the lost worker held the only copy of its shards, so the members of the new
generation reload every shard from the newest sharded checkpoint, resharded to their group, and go on from
there.

zero1/zero2/zero3 keep each stretch of the optimizer state (zero3: of the parameters too) on one worker only:
no survivor can hand it on, so the replicated heal's state transfer (transfer.py) cannot work. Instead, once
the new generation's group formed (supervisor.py), in the same processes:

1. every member picks the newest sharded checkpoint that verifies (the same on every rank: one all-gather);
   none yet: the job ends with one line (the shards are lost and nothing can be saved; a later ``--resume``
   starts over, a lower ``checkpoint.every_steps`` shortens what a loss costs);
2. the old trainer's files are closed and its threads ended, and the trainer is built again at the new world
   size over the new group (``build_trainer``: the strategy shards the model and optimizer for the members,
   loaders and ledger for their ranks), as a restart would build it, but without a process restart;
3. the checkpoint is loaded into the new layout (DCP reshards it, as ``--resume`` at another worker count
   does), which rewinds the model, optimizer, sampler, step and precision to the checkpoint's step; the
   writer's ledger is cut back to it when training starts again, so every sample is still used exactly once;
4. the heal record reports ``steps_lost`` = the steps applied since that checkpoint, ``reloaded`` = its name.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringtrain.checkpoint.front import newest_verified
from ringtrain.heal.membership import Generation, HealFailed
from ringtrain.train.resume import check_same_choice

if TYPE_CHECKING:
    from ringtrain.heal.supervisor import Rebuild
    from ringtrain.train.loop import Trainer

__all__ = ["reload_shards", "newest_sharded_checkpoint"]


def reload_shards(old: Trainer, generation: Generation, rebuild: Rebuild, applied_step: int,
                  record: dict[str, Any] | None) -> tuple[Trainer, int, str]:
    """The trainer rebuilt on ``generation``'s group at the newest sharded checkpoint's state: (trainer, steps
    lost since that checkpoint, its name)."""
    from ringtrain.heal.supervisor import context_for  # the supervisor imports this module lazily

    started = time.perf_counter()
    found = newest_verified(old.checkpoints.directory)
    check_same_choice(-1 if found is None else found.step)
    step = record["step"] if record is not None else old.state.step + 1
    if found is None or not found.sharded:
        lost = record["lost_ranks"] if record is not None else []
        raise HealFailed(
            f"step {step}: {_ranks(lost)} lost, and comm.strategy = '{old.parts.strategy.name}' held shards only "
            "there; no sharded checkpoint was saved yet, so there is nothing to reload and this step cannot be "
            "saved: --resume starts over (set a lower checkpoint.every_steps so that a lost worker costs fewer steps)"
        )
    old.close()
    ctx = context_for(old.ctx, generation)
    old.parts.job_store.is_writer = ctx.rank == 0  # rank 0 lost: this worker now counts the job's progress
    new = rebuild(ctx)
    new.carry_over(old)
    new.load_checkpoint(found)
    steps_lost = max(0, applied_step - new.state.step)
    new.parts.job_store.add_steps_lost(steps_lost)  # the writer counts them for summary.json
    new.start()
    if record is not None:
        record["reload_s"] = round(time.perf_counter() - started, 3)
    if ctx.rank == 0:
        print(f"ringtrain: the lost worker held the only copy of its shards: {ctx.world_size} workers reloaded "
              f"{found.path.name} (step {new.state.step}); {steps_lost} steps since it are redone",
              file=sys.stderr, flush=True)
    return new, steps_lost, found.path.name


def newest_sharded_checkpoint(directory: Path) -> Path | None:
    """The newest committed sharded checkpoint that verifies (None: there is none, or a full one is newer)."""
    found = newest_verified(directory)
    return found.path if found is not None and found.sharded else None


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "a worker was"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
