"""Run one training job inside an initialised process group; check a run directory before that."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any


from ringtrain.checkpoint.front import newest_verified
from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import check_loadable as check_sharded
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import read_verified
from ringtrain.config import Config
from ringtrain.config.schema import RELOADED_STRATEGIES
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import DistContext, leave_default_group, prepare_process
from ringtrain.dist.jobstore import NullJobStore, connect_job_store
from ringtrain.dist.watch import HEARTBEAT_INTERVAL_S, Heartbeat
from ringtrain.heal.membership import HEAL_BEAT_S, Generation, Membership, request_join
from ringtrain.heal.supervisor import Supervisor
from ringtrain.errors import CheckpointError, ConfigError
from ringtrain.train.build import build_trainer
from ringtrain.train.resume import ResumePlan
from ringtrain.train.run_lock import RunDirLock
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
    problems: list[str] = []
    # Corruption skips a checkpoint (the workers warn about it and take the next); UnsafeCheckpoint (tampered
    # sharded metadata) stops the job here.
    if newest_verified(manager.directory, problems.append, check_sharded=check_sharded) is not None:
        return
    found = f" ({'; '.join(p.split('; skipping')[0] for p in problems)})" if problems else ""
    raise CheckpointError(f"--resume: no valid checkpoint in {manager.directory}{found}; run without --resume to start afresh")


def run_training(config: Config, ctx: DistContext, plan: ResumePlan, user: UserParts | None = None) -> dict[str, Any]:
    """Build the trainer (on the user's parts, if given), continue from a checkpoint when the plan says so,
    train, return the summary."""
    job_store = connect_job_store(ctx.env, is_writer=ctx.rank == 0)
    if config.dist.heal:
        return _run_healing(config, ctx, plan, user, job_store)
    trainer = build_trainer(config, ctx, job_store, user)
    # The heartbeat lets a failed collective name the rank that stopped responding.
    # It is also the watchdog that writes the flight recorder when asked (SIGUSR1 to the launcher).
    with _writer_lock(config, ctx), Heartbeat(job_store, ctx.rank, HEARTBEAT_INTERVAL_S,
                                              on_dump_request=trainer.dump_flight):
        trainer.resume(plan)
        try:
            return trainer.fit()
        finally:
            trainer.end_threads()


def _run_healing(config: Config, ctx: DistContext, plan: ResumePlan, user: UserParts | None,
                 job_store: NullJobStore) -> dict[str, Any]:
    """``--heal``: the launched workers are generation 0's members (member id = first rank); a supervisor
    drives the trainer through every failure and admission (ringtrain/heal/supervisor.py)."""
    generation = Generation(0, tuple(range(ctx.world_size)), member=ctx.rank)
    attempt = f"{ctx.env.master_port}-{ctx.env.restart_count}"  # one rendezvous round: one port
    membership = Membership(job_store, generation, config.dist.timeout_s, attempt=attempt)
    membership.register()
    if ctx.rank == 0:
        membership.publish_attempt(attempt)  # where a joining worker asks to be admitted
    supervisor = _supervisor(config, ctx.env, job_store, user, membership)
    trainer = build_trainer(config, ctx, job_store, user, healing=supervisor)
    with _writer_lock(config, ctx), Heartbeat(job_store, ctx.rank, HEAL_BEAT_S,
                                              on_dump_request=lambda reason: supervisor.dump(reason)):
        trainer.resume(plan)
        try:
            return supervisor.run(trainer)
        finally:
            supervisor.trainer.end_threads()


def _supervisor(config: Config, env: DistEnv, job_store: NullJobStore, user: UserParts | None,
                membership: Membership) -> Supervisor:
    supervisor = Supervisor(membership, env.heal_min_workers or 1, env.heal_max_workers,
                            rebuild=lambda ctx: build_trainer(config, ctx, job_store, user, healing=supervisor),
                            reloads=config.comm.strategy in RELOADED_STRATEGIES)
    return supervisor


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
    beating: list[Heartbeat] = []

    def beat(member: int) -> None:  # from the request on: the members tell a live joiner from a hung one
        beating.append(Heartbeat(job_store, member, HEAL_BEAT_S).__enter__())

    try:
        membership, generation = request_join(job_store, config.dist.timeout_s, on_member=beat)
        env = dataclasses.replace(env, rank=generation.rank, world_size=generation.world_size)
        backend, device = prepare_process(env, config.dist)
        # Built before its group forms (no collective: the module is wrapped once it received the state).
        ctx = DistContext(env, backend, device, host_rank=0, host_world_size=1)
        supervisor = _supervisor(config, env, job_store, user, membership)
        trainer = build_trainer(config, ctx, job_store, user, healing=supervisor, joining=True)
        beating[0].on_dump_request = supervisor.dump
        try:
            return supervisor.run(trainer, joining=True)
        finally:
            supervisor.trainer.end_threads()
            leave_default_group()
    finally:
        for heartbeat in beating:
            heartbeat.__exit__(None, None, None)


def _writer_lock(config: Config, ctx: DistContext) -> AbstractContextManager:
    # Only the writer (rank 0) writes the run directory; the other ranks hold nothing. (Under --heal a worker
    # that becomes rank 0 takes the lock over once its predecessor's process is gone: heal/supervisor.py.)
    return RunDirLock(config.run_dir) if ctx.rank == 0 else nullcontext()


def _manager(config: Config) -> CheckpointManager:
    return CheckpointManager(Path(config.run_dir) / config.checkpoint.dir, is_writer=False)
