"""Run one training job inside an initialised process group; check a run directory before that.

A run's user parts are checked together first (train/user_checks.py: the ranks' dataset lengths, one eval batch
through model, loss and metrics); a resumed run that finished already is left as it is (its summary returned).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ringtrain.checkpoint.front import newest_verified
from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import check_loadable as check_sharded
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import read_verified
from ringtrain.config import Config
from ringtrain.config.parallel import resolve_layout
from ringtrain.comm.objects import all_gather_json
from ringtrain.strategies import strategy_spec
from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext, leave_default_group, prepare_process
from ringtrain.group.jobstore import NullJobStore, connect_job_store
from ringtrain.group.watch import HEARTBEAT_INTERVAL_S, Heartbeat
from ringtrain.heal.membership import HEAL_BEAT_S, Generation, Membership, request_join
from ringtrain.heal.supervisor import Supervisor
from ringtrain.errors import CheckpointError, ConfigError
from ringtrain.train.build import build_trainer
from ringtrain.train.resume import ResumePlan
from ringtrain.train.run_lock import RunDirLock
from ringtrain.train.user_checks import check_lengths, check_one_batch
from ringtrain.train.user_parts import UserParts

__all__ = ["check_run_dir", "check_resume", "run_training", "run_joined_training", "RunDirLock", "FitResult",
           "ResumeWords", "RUN_WORDS", "FIT_WORDS"]



@dataclass(frozen=True)
class ResumeWords:
    """How the user asks, in the launch mode in use, to continue a run, to start from a checkpoint, or to use
    another run directory: the errors below name what works there (a flag of `ringtrain train`, or fit's
    arguments and environment variables under python and torchrun)."""

    resume: str = "add --resume to continue it"
    resume_from: str = "--resume-from"
    run_dir: str = "pass --run-dir NEW_DIR to start another run"
    fresh: str = "run without --resume to start afresh"
    asked: str = "--resume"


RUN_WORDS = ResumeWords("add --resume to `ringtrain run` (or pass fit(resume=True)) to continue it", "--resume-from",
                        "pass --run-dir NEW_DIR (or fit(run_dir=NEW_DIR)) to start another run",
                        "run without --resume to start afresh")
"""`ringtrain run SCRIPT`: its flags, or the script's fit() arguments."""
FIT_WORDS = ResumeWords("pass fit(resume=True) (or set RINGTRAIN_RESUME=resume) to continue it", "fit(resume=PATH)",
                        "pass fit(run_dir=NEW_DIR) (or set RINGTRAIN_RUN_DIR=NEW_DIR) to start another run",
                        "drop fit(resume=...) (and RINGTRAIN_RESUME) to start afresh", "fit(resume=True)")
"""python or torchrun: fit()'s arguments, or the environment variables it reads."""


def check_run_dir(config: Config, resume: bool, words: ResumeWords = ResumeWords()) -> None:
    """Refuse to start a fresh run over a run directory that holds checkpoints: that would lose work."""
    if resume:
        return
    manager = _manager(config)
    latest = manager.latest() or next(reversed(committed_sharded(manager.directory)), None)
    if latest is not None:
        raise ConfigError(
            f"run directory {config.run_dir} already holds checkpoints (latest {latest.name}); "
            f"{words.resume}, or {words.run_dir}"
        )


def check_resume(config: Config, resume: bool, resume_from: str | None, words: ResumeWords = ResumeWords(),
                 verify: bool = True) -> None:
    """Everything about resuming a user can get wrong, checked before any worker starts. ``verify``: read
    the checkpoints too (the launcher does; every rank of fit() checks only that they are there, and the
    trainer verifies the one it loads)."""
    if resume and resume_from:
        raise ConfigError("pass --resume (continue this run) or --resume-from PATH (start a new run from PATH), not both")
    if resume_from:
        path = Path(resume_from)
        if not path.is_file():
            raise CheckpointError(f"{words.resume_from} {path}: no such checkpoint file")
        if verify:
            read_verified(path)  # CorruptCheckpoint names the file and what is wrong with it
        latest = _manager(config).latest()
        if latest is not None:
            raise ConfigError(
                f"{words.resume_from} starts a new run, but {config.run_dir} already holds checkpoints (latest "
                f"{latest.name}); {words.run_dir}, or {words.resume}"
            )
        return
    if not resume:
        check_run_dir(config, resume=False, words=words)
        return
    manager = _manager(config)
    if not verify and (manager.checkpoints() or committed_sharded(manager.directory)):
        return
    problems: list[str] = []
    # Corruption skips a checkpoint (the workers warn about it and take the next); UnsafeCheckpoint (tampered
    # sharded metadata) stops the job here.
    if newest_verified(manager.directory, problems.append, check_sharded=check_sharded) is not None:
        return
    found = f" ({'; '.join(p.split('; skipping')[0] for p in problems)})" if problems else ""
    raise CheckpointError(f"{words.asked}: no valid checkpoint in {manager.directory}{found}; {words.fresh}")


def plan_resume(env: DistEnv, resume: bool | str | Path, config: Config, words: ResumeWords,
                checked: bool = False) -> ResumePlan:
    """What a worker continues from, for every way in (``ringtrain train``'s workers, ``fit``, ``Session``):
    ``ringtrain run``'s --resume / --resume-from (RINGTRAIN_RESUME, which a user may set under python or torchrun
    too), else ``resume`` (True: the run directory's newest checkpoint; a path: a new run from it). A restarted
    worker, or one whose launcher checked the run directory (``checked``; RINGTRAIN_RESUME=checked), continues
    from the newest checkpoint; else a fresh run, refused over a run directory with checkpoints. What the user
    asked for is checked here, on every rank, before the group forms (not again where the launcher did)."""
    if not isinstance(resume, (bool, str, Path)):
        raise ConfigError(f"resume must be True (continue the run directory) or a checkpoint path, not "
                          f"{type(resume).__name__}")
    if env.resume and env.resume not in ("resume", "checked") and not env.resume.startswith("from:"):
        raise ConfigError(f"RINGTRAIN_RESUME={env.resume!r}: use 'resume' (continue the run directory) or "
                          "'from:PATH' (start from a checkpoint)")
    checked = checked or env.resume == "checked"
    source = env.resume.removeprefix("from:") if env.resume and env.resume.startswith("from:") else None
    required = env.resume == "resume"
    if source is None and not required:
        source = str(resume) if isinstance(resume, (str, Path)) and str(resume) else None
        required = resume is True
    if source is not None or required:
        if not (env.is_restart or checked):
            check_resume(config, required, source, words, verify=False)
        return ResumePlan(resume=True, source=Path(source) if source else None, required=source is None)
    if env.is_restart or checked:
        return ResumePlan(resume=True)
    check_resume(config, False, None, words)  # a fresh run over checkpoints would lose them
    return ResumePlan.fresh()


class FitResult(dict):
    """What ``ringtrain.fit`` returns: the run's summary (the dict of summary.json, so ``summary = fit(...)``
    reads as before), with the trained model as ``result.model``."""

    def __init__(self, summary: dict[str, Any], model: nn.Module | None = None, rank: int = 0):
        super().__init__(summary)
        self.rank = rank
        """This worker's rank when the run ended (every rank gets a result)."""
        self.model = model
        self.best: dict[str, Any] | None = None
        """``fit(keep_best=...)``: the best evaluation's model, ``{"metric", "mode", "value", "step", "epoch",
        "path"}`` (``path``: RUN_DIR/best/model.safetensors, the module's weights by its own names: load them with
        ``model.load_state_dict(safetensors.torch.load_file(path))``); None when nothing is kept."""
        """The trained module: the one fit() was given (trained in place) or the factory's. Under zero3 or
        fsdp, a new module from the factory holding the gathered weights (None for a module instance)."""

    @property
    def is_main(self) -> bool:
        """Whether this worker is rank 0: the one to print the result or save your own files."""
        return self.rank == 0


def run_training(config: Config, ctx: DistContext, plan: ResumePlan, user: UserParts | None = None,
                 on_start: Callable[[], None] | None = None, keep_model: bool = False) -> FitResult:
    """Build the trainer on ``user``'s parts (else the config's: its factories or its built-in workload), check
    them together, continue from a checkpoint when the plan says so, train (under --heal, driven by the heal's
    supervisor), return the summary (with the trained model if ``keep_model``). A resumed run that finished
    already returns its summary.json and touches nothing. ``on_start``: called (rank 0) once training is about
    to start."""
    job_store = connect_job_store(ctx.env, is_writer=ctx.rank == 0)
    parts = user if user is not None else UserParts.from_config(config)
    check_lengths(parts)  # before anything is built: the sampler deals from the length
    supervisor = _start_healing(config, ctx, job_store, parts) if config.dist.heal else None

    def build(joining: bool = False):
        trainer = build_trainer(config, ctx, job_store, parts, healing=supervisor, joining=joining)
        check_one_batch(trainer, parts, config.train.local_batch_size)
        return trainer

    def prepare(trainer) -> dict[str, Any] | None:
        trainer.resume(plan)
        return _finished(trainer, plan)

    trainer = None if supervisor else build()
    # The heartbeat lets a failed collective name the rank that stopped responding.
    # It is also the watchdog that writes the flight recorder when asked (SIGUSR1 to the launcher).
    beat_s, dump = (HEAL_BEAT_S, supervisor.dump) if supervisor else (HEARTBEAT_INTERVAL_S, trainer.dump_flight)
    with _writer_lock(config, ctx), Heartbeat(job_store, ctx.rank, beat_s, on_dump_request=dump):
        # Under --heal a worker lost while the group starts (the wrap's broadcast, the resume) is healed too.
        trainer, summary = supervisor.start(build, prepare) if supervisor else (trainer, None)
        try:
            if supervisor is None:
                summary = prepare(trainer)
            if summary is None:
                if on_start is not None:
                    on_start()
                summary = supervisor.run(trainer) if supervisor else trainer.fit()
            final = supervisor.trainer if supervisor else trainer  # a heal rebuilds the trainer
            if summary.get("spared"):  # its replica left the job (heal/replicas.py): no group, no model to hand back
                return FitResult(summary, None, rank=final.ctx.rank)
            result = FitResult(summary, _trained_model(final, parts) if keep_model else None, rank=final.ctx.rank)
            result.best = final.parts.best.record()
            return result
        finally:
            (supervisor.trainer if supervisor else trainer).end_threads()


def _finished(trainer, plan: ResumePlan) -> dict[str, Any] | None:
    """A resumed run whose newest checkpoint is its last step and whose summary.json is written is done (see
    ``finished_summary``)."""
    if not plan.resume:  # the same plan on every rank (one launch, one environment): no collective for it
        return None
    return finished_summary(trainer.config.run_dir, trainer.finished, trainer.ctx.rank, trainer.state.step)


def finished_summary(run_dir: str | Path, finished: bool, rank: int, step: int) -> dict[str, Any] | None:
    """A resumed run that is ``finished`` (its step is the planned last one) with its summary.json written is
    done: its summary (every rank), one line from rank 0, and nothing written (no evaluation, summary or
    record). None (on every rank) otherwise. ``fit``, ``ringtrain train`` and the Session ask it alike."""
    path = Path(run_dir) / "summary.json"
    done = finished and path.is_file()
    if dist.is_initialized() and dist.get_world_size() > 1:
        done = all(all_gather_json(bool(done)))  # every rank trains, or none does
    if not done:
        return None
    if rank == 0:
        print(f"ringtrain: run directory {run_dir} already finished at step {step} ({path.name}); nothing to do",
              file=sys.stderr, flush=True)
    return json.loads(path.read_text())


def _trained_model(trainer, parts: UserParts) -> nn.Module | None:
    """The trained module, released from the strategy: replicated strategies (and zero1/zero2, whose module
    holds every parameter) hand back the module itself; zero3 and fsdp gather the full weights (a collective,
    every rank) into a new module from the user's factory, as do the strategies that split the model (tensor
    and pipeline parallelism)."""
    split = trainer.parts.strategy.splits_model
    spec = strategy_spec(trainer.config.comm.strategy)
    if spec.module_is_users and not split:
        if spec.leaves_group:
            trainer.leave_group()  # DDP's or the manual strategy's hooks and buckets go
        return trainer.module
    state = trainer.parts.strategy.model_state_dict(trainer.model)
    if isinstance(parts.model, nn.Module):
        return None
    model = parts.build_model(trainer.config.train.seed)
    model.load_state_dict(state)
    return model


def _start_healing(config: Config, ctx: DistContext, job_store: NullJobStore, parts: UserParts) -> Supervisor:
    """``--heal``: the launched workers are generation 0's members (member id = first rank); a supervisor
    drives the trainer through every failure and admission (ringtrain/heal/supervisor.py)."""
    _check_min_workers(config, ctx.env)
    generation = Generation(0, tuple(range(ctx.world_size)), member=ctx.rank)
    attempt = f"{ctx.env.master_port}-{ctx.env.restart_count}"  # one rendezvous round: one port
    membership = Membership(job_store, generation, config.dist.timeout_s, attempt=attempt)
    membership.register()
    if ctx.rank == 0:
        membership.publish_attempt(attempt)  # where a joining worker asks to be admitted
    return _supervisor(config, ctx.env, job_store, parts, membership)


def _replica_size(config: Config, world_size: int) -> int:
    """The ranks of one model-parallel replica (tp x cp x pp) of the job's layout at ``world_size``."""
    return resolve_layout(config.parallel, config.comm.strategy, world_size).model_parallel


def _check_min_workers(config: Config, env: DistEnv) -> None:
    """A split model heals by whole replicas: --min-nproc must be a whole number of them."""
    size = _replica_size(config, env.world_size)
    if size > 1 and env.heal_min_workers and env.heal_min_workers % size:
        raise ConfigError(f"--min-nproc {env.heal_min_workers} with a model split over {size} ranks (tp x cp x pp): "
                          f"a split model heals by whole replicas of {size} workers; set --min-nproc to a multiple "
                          f"of {size}")


def _supervisor(config: Config, env: DistEnv, job_store: NullJobStore, parts: UserParts,
                membership: Membership) -> Supervisor:
    supervisor = Supervisor(membership, env.heal_min_workers or 1, env.heal_max_workers,
                            rebuild=lambda ctx: build_trainer(config, ctx, job_store, parts, healing=supervisor),
                            reloads=strategy_spec(config.comm.strategy).reloads)
    return supervisor


def run_joined_training(config: Config, env: DistEnv, user: UserParts | None = None) -> FitResult:
    """``ringtrain join`` of a --heal job: ask to be admitted, meet the running workers in a new group at
    their next step boundary, receive their state (no checkpoint read), train with them."""
    if strategy_spec(config.comm.strategy).reloads:
        raise ConfigError(
            f"ringtrain join: this --heal job runs comm.strategy = '{config.comm.strategy}', healed by reloading "
            "shards from its checkpoints; admitting a worker into it is not supported: it goes on with the workers "
            "it has (grow it with a restart: ringtrain train ... --resume)"
        )
    job_store = connect_job_store(env, is_writer=False)
    parts = user if user is not None else UserParts.from_config(config)
    beating: list[Heartbeat] = []

    def beat(member: int) -> None:  # from the request on: the members tell a live joiner from a hung one
        beating.append(Heartbeat(job_store, member, HEAL_BEAT_S).__enter__())

    try:
        membership, generation = request_join(job_store, config.dist.timeout_s, on_member=beat)
        env = dataclasses.replace(env, rank=generation.rank, world_size=generation.world_size)
        backend, device = prepare_process(env, config.dist)
        # Built before its group forms (no collective: the module is wrapped once it received the state).
        ctx = DistContext(env, backend, device, host_rank=0, host_world_size=1)
        supervisor = _supervisor(config, env, job_store, parts, membership)
        beating[0].on_dump_request = supervisor.dump
        # A split model (tp, cp or pp): admitted with a whole replica, built once its group formed (its mesh
        # needs the group), its part received from its counterpart (heal/replicas.py).
        split = _replica_size(config, generation.world_size) > 1
        trainer = None if split else build_trainer(config, ctx, job_store, parts, healing=supervisor, joining=True)
        try:
            if split:
                trainer = supervisor.join_replica(ctx)
            summary = supervisor.run(trainer, joining=not split)
            return FitResult(summary, rank=supervisor.trainer.ctx.rank)
        finally:
            if supervisor.trainer is not None:
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
