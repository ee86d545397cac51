"""Healing in place, the trainer's half: after a lost worker, redo the failed step among the survivors.

``dist/heal.py`` decides who is left and builds their new process group; this module makes the trainer
whole again on it, without reading a checkpoint:

1. publish the failure, drop everything that hangs off the broken group (the DDP wrapper or the manual
   strategy's hooks) and abandon the group;
2. agree on the next generation (``Membership.agree``) and init its group (new rank = order among the
   survivors);
3. bring every survivor to the same state: a collective can complete on one rank and fail on another, so
   some may have applied the failed step. They compare (step, parameter digest); any that differ receive
   the newest state (model, optimizer, sampler, step, precision, micro-batch) from the first rank that has
   it, and check its sha256 against the sender's. Those that had not applied it put back the module's
   buffers (BatchNorm statistics) as they were before the step's forwards;
4. rebuild what depends on the group or the rank: the strategy (DDP or manual) around the same module, the
   step loader (the rest of the epoch re-dealt over the survivors: the failed step's whole window is
   redone, accumulation keeps global_batch_size), the micro-batch plan, the guard, the watch, and the
   writer's parts when rank 0 changed hands (loggers, checkpoints, ledger);
5. go on. The first step that completes writes the heal's record (``type = "heal"``) and console line.

Fencing: a member that was cut off (stopped past timeout_s, then resumed) finds a newer generation in the
job store before any write (checkpoint, metrics, ledger, flight recorder) and exits with one line,
having written nothing. When fewer than ``--min-nproc`` workers remain, the survivors save the step they
reached and exit with one line (``--resume`` continues).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.data.ledger import build_ledger
from ringtrain.dist.group import host_placement
from ringtrain.dist.heal import (
    Fenced,
    Generation,
    HealFailed,
    Membership,
    abandon_group,
    init_generation_group,
)
from ringtrain.dist.watch import CollectiveFailed, CollectiveWatch, flight_dumper
from ringtrain.monitor.loggers import Logger, build_logger
from ringtrain.parallel import build_strategy
from ringtrain.train.batch_size import BufferSnapshot, MicroBatcher
from ringtrain.train.guards import StepGuard
from ringtrain.train.heal_reload import shards_lost
from ringtrain.train.optim import load_optimizer_state, position_lr_scheduler
from ringtrain.train.step import GradientStep

if TYPE_CHECKING:
    from ringtrain.train.loop import Trainer

__all__ = ["NoHealing", "Healing", "FencedLogger", "state_digest", "receive_state"]


class NoHealing:
    """Healing off: a failed collective ends the worker (and the restart path takes over)."""

    @property
    def count(self) -> int:
        return 0

    catches: tuple[type[BaseException], ...] = ()
    """The failures the loop hands to ``heal`` (none: they propagate)."""

    def begin_step(self) -> None: ...

    def check_fence(self) -> None: ...

    def committed(self, step: int) -> None: ...

    def heal(self, failure: str) -> None:
        raise AssertionError("healing is off")

    def admission_due(self) -> bool:
        return False

    def admit(self) -> None: ...


class Healing(NoHealing):
    """Heals ``trainer`` in place after a lost worker (see the module's docstring)."""

    catches = (CollectiveFailed,)

    def __init__(self, trainer: Trainer, membership: Membership, min_workers: int, max_workers: int | None = None):
        self.trainer = trainer
        self.membership = membership
        self.min_workers = min_workers
        self.max_workers = max_workers
        """Joiners are admitted while the group is smaller than this (None: no limit)."""
        self.last_commit_s = time.time()
        self.pending: dict[str, Any] | None = None
        """The heal whose record waits for the next completed step (recovery_s ends there)."""
        self.buffers: BufferSnapshot | None = None
        self._requests_seen = 0
        """Join requests rank 0 has scheduled (so it asks the store once a step)."""
        self._plan: tuple[int, int] | None = None
        """Rank 0's own admission plan: (generation, after_step)."""
        self.window_starts: dict[int, tuple[int, int]] = {}
        """Step -> (epoch, cursor) where its window starts, for this step and the one before."""
        trainer.logger = FencedLogger(trainer.logger, self)
        trainer.dump_flight = self._fenced_dump(trainer.dump_flight)
        trainer.watch.on_failure = trainer.dump_flight

    @property
    def count(self) -> int:
        """Heals of the whole job so far (kept in the job store: summary.json counts those before a joiner or a
        new rank 0 came too)."""
        return self.membership.store.add("heals", 0)

    # --- around every step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        # The module's buffers before this step's forwards: a redone step must not count them twice.
        self.buffers = BufferSnapshot(self.trainer.module)
        # Where this step's window starts (the sampler moves at the commit): the ledger's line of the last
        # committed step can be rebuilt from it if the writer was lost before writing it (_fix_ledger).
        sampler = self.trainer.parts.sampler
        self.window_starts[self.trainer.state.step + 1] = (sampler.epoch, sampler.cursor)
        self.window_starts.pop(self.trainer.state.step - 1, None)  # the last two steps are enough

    def check_fence(self) -> None:
        # Only rank 0 writes the run directory (loggers, ledger, checkpoints): one store read a step, there.
        if self.trainer.ctx.rank == 0:
            self.membership.check_fence()

    def committed(self, step: int) -> None:
        now = time.time()
        if self.pending is not None:
            record, self.pending = self.pending, None
            record["recovery_s"] = round(now - self.last_commit_s, 3)
            self.trainer.logger.log(record)
        self.last_commit_s = now

    def admission_due(self) -> bool:
        """At a step boundary: is a joining worker (``ringtrain join``) to be admitted now? Rank 0 schedules a
        pending request for after the next step; every rank reads the plan (one store read a step)."""
        trainer, membership = self.trainer, self.membership
        step = trainer.state.step
        if membership.generation.rank != 0:
            plan = membership.admission()
            return plan is not None and plan[0] == step
        # Rank 0 wrote the plan itself: it reads only the request counter.
        if self._plan is not None and self._plan[0] == membership.generation.number:
            return self._plan[1] == step
        room = (self.max_workers or sys.maxsize) - membership.generation.world_size
        if room > 0 and step + 1 < trainer.total_steps:
            requested = membership.store.add("join/requests", 0)
            if requested > self._requests_seen:
                joiners = membership.pending_joiners()[:room]
                if joiners:
                    membership.schedule_admission(step + 1, joiners)
                    self._plan = (membership.generation.number, step + 1)
                self._requests_seen = requested if not joiners else self._requests_seen + len(joiners)
        return False

    def admit(self) -> None:
        """Regroup with the joining workers at this step boundary: a new generation, its group, the strategy
        and loaders rebuilt, then the joiners receive the state (sha256 checked) and everyone goes on."""
        trainer = self.trainer
        started = time.perf_counter()
        _, joiners = self.membership.admission()
        _drop_group_parts(trainer)
        abandon_group(failed=False)
        generation = self.membership.admit(joiners)
        init_generation_group(self.membership, generation, trainer.config.dist.timeout_s, trainer.ctx.backend)
        # Nobody is ahead here: the strategy first (DDP broadcasts rank 0's parameters), then the state.
        _rebuild(trainer, generation)
        _agree_on_state(trainer)
        trainer.logger.log({
            "type": "join", "step": trainer.state.step, "generation": generation.number,
            "joined_ranks": [generation.members.index(j) for j in joiners], "world_size": generation.world_size,
            "admit_s": round(time.perf_counter() - started, 3),
        })

    def _fenced_dump(self, dump):
        if dump is None:
            return None

        def fenced(reason: str) -> None:
            if self.membership.newest() == self.membership.generation.number:
                dump(reason)

        return fenced

    # --- one heal ------------------------------------------------------------------------------------
    def heal(self, failure: str) -> None:
        """Regroup without the lost workers and make the trainer whole on the new group; the caller then
        redoes the failed step from a fresh iterator of the step loader."""
        trainer = self.trainer
        started = time.perf_counter()
        old = self.membership.generation
        failed_step = trainer.state.step + 1
        self.membership.publish_failure(failed_step)
        # Nothing may keep the broken group's objects alive: a DDP reducer's hooks would fire on the next
        # backward. The module stays (the same parameters, optimizer and state).
        _drop_group_parts(trainer)
        abandon_group()
        try:
            generation = self.membership.agree(applied_step=trainer.state.step)
            init_generation_group(self.membership, generation, trainer.config.dist.timeout_s, trainer.ctx.backend)
        except Fenced:
            raise
        except (RuntimeError, ValueError) as err:
            raise HealFailed(f"step {failed_step}: healing failed while regrouping ({_first_line(err)}); resume "
                             "from the last checkpoint with --resume") from None
        lost = [m for m in old.members if m not in generation.members]
        record = {
            "type": "heal",
            "step": failed_step,
            "generation": generation.number,
            "lost_ranks": [old.members.index(m) for m in lost],
            "remaining_ranks": [old.members.index(m) for m in generation.members],
            "world_size": generation.world_size,
        }
        if generation.rank == 0:
            self.membership.store.add("heals", 1)  # the job's count: a joiner or a new writer reports all of them
        if not trainer.parts.strategy.gradients_replicated:  # zero/fsdp: the lost shards are reloaded (heal_reload.py)
            shards_lost(trainer, {**record, "regroup_s": round(time.perf_counter() - started, 3), "cause": failure},
                        self.min_workers, self.last_commit_s)
        if trainer.state.step < failed_step and self.buffers is not None:
            self.buffers.restore()  # this rank had not applied the failed step: its forwards are undone
        source = _agree_on_state(trainer)
        _rebuild(trainer, generation)
        self._fix_ledger(old)
        record = {
            **record,
            "from_step": trainer.state.step,
            "steps_lost": 0,
            "rolled_forward": source is not None,
            "regroup_s": round(time.perf_counter() - started, 3),
            "cause": failure,
        }
        if generation.world_size < self.min_workers:
            trainer._save_checkpoint()
            name = trainer.checkpoints.path_for(trainer.state.step).name
            raise HealFailed(
                f"step {failed_step}: {_ranks(record['lost_ranks'])} lost and only {generation.world_size} worker"
                f"{'s' * (generation.world_size != 1)} remain, below --min-nproc {self.min_workers}: saved {name} "
                f"(step {trainer.state.step}); continue with --resume"
            )
        self.pending = record

    def _fix_ledger(self, old: Generation) -> None:
        """The writer's ledger holds exactly the steps applied: cut back to the agreed step, and if its line is
        missing, record that step's window as it was dealt. It is missing when this rank had not applied the
        step (another survivor had), or when the old writer was lost after the step's gather (every rank
        committed it) but before it wrote the line."""
        trainer = self.trainer
        ledger = trainer.parts.ledger
        if trainer.ctx.rank != 0 or not hasattr(ledger, "path"):
            return
        ledger.close()
        step = trainer.state.step
        ledger.start(step)
        if ledger.last_step() < step and step in self.window_starts:
            epoch, cursor = self.window_starts[step]
            sampler = trainer.parts.sampler
            window = sampler.order(epoch)[cursor : cursor + sampler.global_batch_size]
            shares = [window[r :: old.world_size].tolist() for r in range(old.world_size)]
            ledger.write(step, epoch, shares, skipped=False)


class FencedLogger(Logger):
    """Checks the fence before every write of the writer's loggers (metrics.jsonl, summary.json, console)."""

    def __init__(self, inner: Logger, healing: Healing):
        self.inner = inner
        self.healing = healing

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        self.inner.start(total_steps, start_step, steps_per_epoch)

    def on_step(self, step: int, epoch: int) -> None:
        self.inner.on_step(step, epoch)

    def log(self, record: dict[str, Any]) -> None:
        self.healing.check_fence()
        self.inner.log(record)

    def finish(self, summary: dict[str, Any]) -> None:
        self.healing.check_fence()
        self.inner.finish(summary)

    def close(self) -> None:
        self.inner.close()


def state_digest(module: torch.nn.Module) -> str:
    """sha256 of the module's parameters and buffers, by name."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def receive_state(trainer: Trainer) -> None:
    """A worker admitted by a --heal job, after building its trainer on the new group: the running workers'
    state (model, optimizer, sampler, step), checked against the sender's sha256."""
    _agree_on_state(trainer)


def _drop_group_parts(trainer: Trainer) -> None:
    strategy = trainer.parts.strategy
    if hasattr(strategy, "unwrap"):
        try:
            strategy.unwrap(trainer.parts.model, release=True)  # manual: its hooks and buckets go
        except TypeError:
            strategy.unwrap(trainer.parts.model)
    for param in trainer.module.parameters():
        param.grad = None
    trainer.parts.model = trainer.module
    trainer.model = trainer.module
    trainer.gradient.model = trainer.module


def _agree_on_state(trainer: Trainer) -> int | None:
    """Every survivor at the newest (step, digest): returns the rank it was copied from, or None."""
    mine = (trainer.state.step, state_digest(trainer.module))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    newest = max(step for step, _ in everyone)
    source = next(rank for rank, (step, _) in enumerate(everyone) if step == newest)
    if all(entry == everyone[source] for entry in everyone):
        return None
    for attempt in range(1, SEND_ATTEMPTS + 1):
        payload = [None, None]
        if dist.get_rank() == source:
            buffer = io.BytesIO()
            torch.save(_heal_state(trainer), buffer)
            data = buffer.getvalue()
            payload = [transit_hook(data, attempt), hashlib.sha256(data).hexdigest()]
        dist.broadcast_object_list(payload, src=source)
        data, sent_sha = payload
        intact = torch.tensor([float(hashlib.sha256(data).hexdigest() == sent_sha)])
        dist.all_reduce(intact, op=dist.ReduceOp.MIN)  # everyone learns whether every copy arrived whole
        if intact.item():
            break
        if dist.get_rank() != source and hashlib.sha256(data).hexdigest() != sent_sha:
            print(f"ringtrain: warning: the state received from rank {source} does not match its sha256 "
                  f"(attempt {attempt} of {SEND_ATTEMPTS}); refused, sent again", file=sys.stderr, flush=True)
    else:
        raise HealFailed(f"the state received from rank {source} did not match its sha256 in {SEND_ATTEMPTS} attempts; "
                         "resume with --resume")
    if dist.get_rank() != source:
        _load_heal_state(trainer, torch.load(io.BytesIO(data), weights_only=True))
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (trainer.state.step, state_digest(trainer.module)))
    if len(set(digests)) > 1:
        raise HealFailed(f"after healing the survivors still hold different states {digests}; resume with --resume")
    return source


SEND_ATTEMPTS = 3
"""Sends of the state to survivors or joiners whose copy did not match the sender's sha256."""


def transit_hook(data: bytes, attempt: int) -> bytes:
    """What the sender puts on the wire for ``attempt`` (the data itself; tests replace this to corrupt it)."""
    return data


def _heal_state(trainer: Trainer) -> dict[str, Any]:
    return {
        "model": trainer.module.state_dict(),
        "optimizer": trainer.parts.optimizer.state_dict(),
        "sampler": trainer.parts.sampler.state_dict(),
        "train_state": trainer.state.state_dict(),
        "precision": trainer.precision.state_dict(),
        "micro_batch": trainer.batcher.state_dict(),
    }


def _load_heal_state(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.module.load_state_dict(state["model"])
    load_optimizer_state(trainer.parts.optimizer, state["optimizer"])
    trainer.parts.sampler.load_state_dict(state["sampler"])
    trainer.state.load_state_dict(state["train_state"])
    position_lr_scheduler(trainer.parts.scheduler, trainer.state.step)
    trainer.precision.load_state_dict(state["precision"])
    trainer.batcher.load_state_dict(state["micro_batch"])


def _rebuild(trainer: Trainer, generation: Generation) -> None:
    """Everything that depends on the group, the rank or the world size, rebuilt for ``generation``."""
    config, old_ctx = trainer.config, trainer.ctx
    host_rank, host_world_size = host_placement(old_ctx.env.bind_addr)
    env = dataclasses.replace(old_ctx.env, rank=generation.rank, world_size=generation.world_size)
    ctx = dataclasses.replace(old_ctx, env=env, host_rank=host_rank, host_world_size=host_world_size)
    was_writer, is_writer = old_ctx.rank == 0, ctx.rank == 0
    trainer.ctx = ctx
    parts = trainer.parts
    strategy = build_strategy(config.comm, ctx.device)
    parts.strategy = strategy
    parts.model = strategy.wrap(trainer.module)  # DDP broadcasts rank 0's state: the same on every rank now
    trainer.model = parts.model
    trainer.comm_timer = strategy.comm_timer
    parts.train_loader, parts.eval_loader = parts.loaders(ctx.rank, ctx.world_size)
    batcher = MicroBatcher(config.train, parts.task, ctx.rank, ctx.world_size, ctx.device)
    batcher.load_state_dict(parts.batcher.state_dict())
    parts.batcher = trainer.batcher = batcher
    trainer.gradient = GradientStep(parts, trainer.clock, ctx.world_size, ctx.device)
    trainer.guard = StepGuard(ctx.rank, ctx.world_size, ctx.device, config.train.max_consecutive_nonfinite_steps,
                              trainer.stop_signal)
    healing = trainer.healing
    dump = flight_dumper(config.run_dir, ctx.rank, ctx.world_size) if config.dist.flight_recorder else None
    trainer.dump_flight = healing._fenced_dump(dump)
    trainer.watch = CollectiveWatch(parts.job_store, ctx.rank, ctx.world_size, config.dist.timeout_s,
                                    interval_s=trainer.watch.interval_s, on_failure=trainer.dump_flight,
                                    members=generation.members)
    parts.job_store.is_writer = is_writer
    if is_writer and not was_writer:  # rank 0 was lost: this worker takes over the run directory's files
        logger = build_logger(config, 0, config.run_dir)
        logger.start(trainer.total_steps, trainer.state.step, parts.sampler.steps_per_epoch)
        trainer.logger = FencedLogger(logger, healing)
        trainer.checkpoints = CheckpointManager(trainer.checkpoints.directory, keep_last=config.checkpoint.keep_last,
                                                is_writer=True)
        parts.ledger = build_ledger(config.data.ledger, config.run_dir, parts.sampler.num_samples, 0)
        print(f"ringtrain: rank {old_ctx.rank} is now rank 0 and writes the run directory", file=sys.stderr, flush=True)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
