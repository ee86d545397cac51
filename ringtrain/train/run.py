"""Run one training job inside an initialised process group; check a run directory before that."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import check_loadable as check_sharded
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import read_verified
from ringtrain.config import Config
from ringtrain.config.schema import RELOADED_STRATEGIES
from ringtrain.dist.group import DistContext
from ringtrain.dist.jobstore import connect_job_store
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import init_distributed
from ringtrain.dist.heal import HEAL_BEAT_S, request_join
from ringtrain.train.heal import receive_state
from ringtrain.train.heal_reload import fit_with_reloads
from ringtrain.dist.watch import HEARTBEAT_INTERVAL_S, Heartbeat
from ringtrain.errors import CheckpointError, ConfigError, CorruptCheckpoint
from ringtrain.train.build import build_trainer
from ringtrain.train.resume import ResumePlan
from ringtrain.train.user_parts import UserParts

__all__ = ["check_run_dir", "check_resume", "run_training", "run_joined_training", "RunDirLock"]


def check_run_dir(config: Config, resume: bool) -> None:
    """Refuse to start a fresh run over a run directory that holds checkpoints: that would lose work."""
    if resume:
        return
    manager = _manager(config)
    latest = manager.latest() or next(reversed(committed_sharded(manager.directory)), None)
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
    for path in reversed(committed_sharded(manager.directory)):
        try:
            check_sharded(path)  # corruption skips it; UnsafeCheckpoint (tampered) stops the job here
            return  # the workers resume from a sharded checkpoint (or a newer full one)
        except CorruptCheckpoint as err:
            problems.append(str(err))
    for path in reversed(manager.checkpoints()):
        try:
            read_verified(path)
            return  # the workers start from this one (or warn about newer broken ones first)
        except CorruptCheckpoint as err:
            problems.append(str(err))
    found = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"--resume: no valid checkpoint in {manager.directory}{found}; run without --resume to start afresh")


def run_training(config: Config, ctx: DistContext, plan: ResumePlan, user: UserParts | None = None) -> dict[str, Any]:
    """Build the trainer (on the user's parts, if given), continue from a checkpoint when the plan says so,
    train, return the summary."""
    job_store = connect_job_store(ctx.env, is_writer=ctx.rank == 0)
    trainer = build_trainer(config, ctx, job_store, user)
    # The heartbeat lets a failed collective name the rank that stopped responding.
    # It is also the watchdog that writes the flight recorder when asked (SIGUSR1 to the launcher).
    # Under --heal it beats faster, so that the survivors tell a lost worker from a live one within 0.5 s.
    beat_s = HEAL_BEAT_S if config.dist.heal else HEARTBEAT_INTERVAL_S
    with _writer_lock(config, ctx.rank), Heartbeat(job_store, ctx.rank, beat_s, on_dump_request=trainer.dump_flight):
        trainer.resume(plan)
        # Under --heal with a sharded strategy a lost worker's shards are reloaded from the newest sharded
        # checkpoint on a trainer built again over the survivors (train/heal_reload.py); else this is fit().
        return fit_with_reloads(trainer, lambda ctx, membership: build_trainer(config, ctx, job_store, user,
                                                                              membership=membership))


def run_joined_training(config: Config, env: DistEnv, user: UserParts | None = None) -> dict[str, Any]:
    """``ringtrain join`` of a --heal job: ask to be admitted, meet the running workers in a new group at
    their next step boundary, receive their state (no checkpoint read), train with them."""
    if config.comm.strategy in RELOADED_STRATEGIES:
        raise ConfigError(
            f"ringtrain join: this --heal job runs comm.strategy = '{config.comm.strategy}', healed by reloading "
            "shards from its checkpoints; admitting a worker into it is not supported: it goes on with the workers "
            "it has (grow it with a restart: ringtrain train ... --resume)"
        )
    job_store = connect_job_store(env, is_writer=False)
    membership, generation = request_join(job_store, config.dist.timeout_s)
    env = dataclasses.replace(env, rank=generation.rank, world_size=generation.world_size)
    store = dist.PrefixStore(f"{generation.number}/pg/", membership.store)
    with init_distributed(env, config.dist, store=store) as ctx:
        trainer = build_trainer(config, ctx, job_store, user, membership=membership)
        print(f"ringtrain: joined as rank {ctx.rank} of {ctx.world_size} (generation {generation.number})",
              file=sys.stderr, flush=True)
        with Heartbeat(job_store, generation.member, HEAL_BEAT_S, on_dump_request=trainer.dump_flight):
            receive_state(trainer)
            return trainer.fit()


class RunDirLock:
    """The writer's exclusive lock on a run directory, held while it trains.

    Two groups writing one run directory would interleave checkpoints and ledgers: a user starting the
    same run twice, or an elastic job split in two by a badly tuned rendezvous. The lock (flock, released
    by the kernel when the process dies) makes the second writer wait for the first, then fail naming it.
    """

    def __init__(self, run_dir: str | Path, timeout_s: float = 60.0):
        self.path = Path(run_dir) / ".lock"
        self.timeout_s = timeout_s
        self.fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise ConfigError(
                        f"run directory {self.path.parent} is in use by another training process ({holder}) since "
                        f"{self.timeout_s:g} s; two jobs must not share a run directory: pass --run-dir NEW_DIR"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def _writer_lock(config: Config, rank: int) -> AbstractContextManager:
    # Only the writer (rank 0) writes the run directory; the other ranks hold nothing.
    return RunDirLock(config.run_dir) if rank == 0 else nullcontext()


def _manager(config: Config) -> CheckpointManager:
    return CheckpointManager(Path(config.run_dir) / config.checkpoint.dir, is_writer=False)
