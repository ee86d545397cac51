"""Healing in place: one state machine that drives the trainer from generation to generation.

    ┌──────────► TRAINING (generation g: steps, evaluations, saves, the final summary) ──► FINISHED
    │                │ any failure, anywhere              │ rank 0 planned an admission at this boundary
    │                ▼                                     ▼
    │            FAILED: publish, abandon the group     ADMITTING: leave the group, g+1 = g + joiners
    │                ▼                                     │
    │            AGREEING: wait for every member of g      │
    │            to arrive, finish, or be lost; decide     │
    │                ▼                                     │
    │            FORMING g+1: every member ready, init ◄───┘
    │                │  its group          ─── a failure here: g+1 failed ──► FAILED (again, from here)
    │                ▼
    │            SETTLING: replicated: the newest state from the member that has it (transfer.py), the
    │                │     trainer regrouped around the same module; sharded: rebuilt and reloaded from the
    │                │     newest sharded checkpoint (reload.py); a split model (tp/cp/pp): rebuilt for the
    │                │     whole replicas left, each rank's part moved over (replicas.py)  ── a failure ──► FAILED
    │                ▼
    └──────────── below --min-nproc with steps left: save (replicated) and end in one line
                  else go on; the heal's record is written when the next step completes

Every failure is a failure of the current generation, wherever it comes from: the start (the strategy's wrap,
the resume: ``start``), a step's collectives, the ledger's gather, an epoch-end evaluation, a sharded save's
own group, the last save, the summary, an admission, or the heal itself (a second worker lost while the
survivors agree, form or compare state). The survivors heal again from wherever they are while ``--min-nproc``
remain. A member that fails on its own (an error that is not a lost peer) says so and every member stops with
its line (``MemberFailed``): healing would meet the same error again.

A split model heals by whole model-parallel replicas (replicas.py): a lost rank takes its replica's other
ranks out of the job with it (they exit cleanly: ``Spared``), and the heal's record names the replica.

Liveness is certain (membership.py, liveness.py): a member is lost when its process exited (this host's
/proc, or the exit its launcher recorded), when it withdrew (a joiner that left), or when its heartbeat stood
still for ``dist.timeout_s`` (hung or stopped); a live member is always waited for.

The trainer meets this machine only at its seams (``train/healing_hooks.py``): ``at_boundary`` (may raise
``Regroup`` for an admission), ``begin_step``, ``committed``, ``check_fence`` before every write, and the
logger and flight recorder wrapped to check the fence too.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ringtrain.comm.errors import CollectiveError
from ringtrain.group.init import DistContext
from ringtrain.host.pinning import host_placement
from ringtrain.group.sockets import new_recorded_group
from ringtrain.group.watch import CollectiveFailed, first_line, is_comm_error
from ringtrain.errors import RingtrainError
from ringtrain.heal.groups import abandon_group
from ringtrain.heal.membership import (
    HEAL_BEAT_S,
    Fenced,
    Generation,
    GenerationFailed,
    HealFailed,
    Membership,
    MemberFailed,
    Spared,
    admit_whole_replicas,
)
from ringtrain.heal.replicas import move_to_group, replica_of, replica_size
from ringtrain.heal.transfer import NO_STATE, agree_on_state, check_agreed, state_digest
from ringtrain.monitor.loggers import Logger
from ringtrain.testing import faults
from ringtrain.train.batch_size import BufferSnapshot
from ringtrain.train.guards import Stopped
from ringtrain.train.healing_hooks import NoHealing
from ringtrain.train.run_lock import RunDirLock

if TYPE_CHECKING:
    from ringtrain.train.loop import Trainer

__all__ = ["Supervisor", "Regroup", "failure_of", "FencedLogger"]

Rebuild = Callable[[DistContext], "Trainer"]
"""Builds a trainer for a group (``build_trainer`` with the run's config and parts and this supervisor)."""

REPEATS_WITHOUT_LOSS = 3
"""Failures in a row at one step with no member lost: then it is not a lost worker, and healing stops."""


class Regroup(Exception):
    """Raised out of ``Trainer.train`` at a step boundary: an admission is due."""


def failure_of(err: BaseException) -> str | None:
    """The line of a failure of the generation (a lost or hung peer, the group broken under this rank), or None
    for any other error (the model's, the data's, a file's: not something a heal can mend)."""
    if isinstance(err, (CollectiveFailed, GenerationFailed)):
        return str(err)
    if isinstance(err, RingtrainError):
        return None
    comm_kinds = (RuntimeError, ValueError, ConnectionError, CollectiveError, dist.DistError)
    if isinstance(err, comm_kinds) or type(err).__name__ == "CheckpointException":
        if is_comm_error(err):
            lines = [line for line in str(err).strip().splitlines() if line.strip()]
            return first_line(lines[-1] if lines else type(err).__name__)
    return None


class Supervisor(NoHealing):
    """The trainer's seams under --heal, and the machine that drives it (see the module's docstring)."""

    beat_s = HEAL_BEAT_S

    def __init__(self, membership: Membership, min_workers: int, max_workers: int | None, rebuild: Rebuild,
                 reloads: bool):
        self.membership = membership
        self.min_workers = min_workers
        self.max_workers = max_workers
        """Joiners are admitted while the group is smaller than this (None: no limit)."""
        self.rebuild = rebuild
        self.reloads = reloads
        """A sharded strategy: the lost worker held the only copy of its shards, so healing reloads them."""
        self.new_group = new_recorded_group
        self.trainer: Trainer | None = None
        self.pending: list[dict[str, Any]] = []
        """Heal records waiting for the next completed step (recovery_s ends there)."""
        self.last_commit_s = time.time()
        self.buffers: BufferSnapshot | None = None
        self.window_starts: dict[int, tuple[int, int, int]] = {}
        """Step -> (epoch, cursor, data-parallel size) of its window, for this step and the one before."""
        self._plan: tuple[int, int] | None = None
        """Rank 0's own admission plan: (generation, after_step)."""
        self._scanned = (-1, -1)
        """(generation, join requests) when rank 0 last looked for joiners: it looks again when either changes."""
        self._rescan = False
        """A request seen before its worker registered: look again at the next boundary."""
        self._waiting: list[int] = []
        """Joiners rank 0 last said wait for more to complete a replica (said again when they change)."""
        self._has_state = True
        self._repeats = 0
        self._lock: RunDirLock | bool | None = None

    # --- the seams the trainer calls -------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Heals of the whole job so far (kept in the job store: a joiner or a new writer counts all of them)."""
        return self.membership.store.add("heals", 0)

    def begin_step(self) -> None:
        trainer = self.trainer
        # The module's buffers before this step's forwards: a redone step must not count them twice.
        self.buffers = BufferSnapshot(trainer.module)
        # Where this step's window starts (the sampler moves at the commit): the ledger's line of the last
        # committed step can be rebuilt from it if the writer was lost before writing it (_fix_ledger).
        sampler, step = trainer.parts.sampler, trainer.state.step
        # (Dealt over the ranks that read different samples: a split model's data-parallel ranks, not its world.)
        self.window_starts[step + 1] = (sampler.epoch, sampler.cursor, trainer.ctx.dp_size)
        self.window_starts.pop(step - 1, None)  # the last two steps are enough

    def check_fence(self) -> None:
        # Only rank 0 writes the run directory (loggers, ledger, checkpoints): one store read a write, there.
        if self.trainer is None or self.trainer.ctx.rank == 0:
            self.membership.check_fence()

    def _regroup_whole(self) -> None:
        """Leave ``train()`` for an admission, every member on one model first: DiLoCo's workers run a whole
        outer step in the group they are in (all of them at this boundary), so no inner progress is lost and a
        joiner starts from the model everyone holds."""
        self.trainer.parts.strategy.outer_loop.end_of_run()
        raise Regroup()

    def committed(self, step: int) -> None:
        now = time.time()
        self._repeats = 0
        self.buffers = None  # the step is applied: its buffers are the new ones, nothing to put back
        for record in self.pending:
            record["recovery_s"] = round(now - self.last_commit_s, 3)
            self.trainer.logger.log(record)
        self.pending = []
        self.last_commit_s = now

    def at_boundary(self) -> None:
        """Rank 0 schedules a pending join request for after the next step; every rank reads the plan (one store
        read a step) and leaves ``train()`` there."""
        if self.reloads:
            return  # joiners are refused by sharded jobs (run.py)
        trainer, membership = self.trainer, self.membership
        step, number = trainer.state.step, membership.generation.number
        if membership.generation.rank != 0:
            plan = membership.admission()
            if plan is not None and plan[0] == step:
                self._regroup_whole()
            return
        if self._plan is not None and self._plan[0] == number:
            if self._plan[1] == step:
                self._regroup_whole()
            return
        room = (self.max_workers or sys.maxsize) - membership.generation.world_size
        if room <= 0 or step + 1 >= trainer.total_steps:
            return
        requested = membership.join_requests()
        if self._scanned == (number, requested) and not self._rescan:
            return
        pending, unregistered = membership.pending_joiners()
        self._scanned, self._rescan = (number, requested), unregistered > 0
        size = replica_size(trainer)
        admitted, missing = admit_whole_replicas(pending, size, room)  # a split model: whole replicas only
        if missing and self._waiting != pending:
            self._waiting = pending
            waiting = pending[len(admitted):]
            print(f"ringtrain: member{'s' * (len(waiting) > 1)} {', '.join(map(str, waiting))} asked to join: waiting "
                  f"for {missing} more to complete a replica of {size} workers (tp x cp x pp), admitted together",
                  file=sys.stderr, flush=True)
        if admitted:
            membership.schedule_admission(step + 1, admitted)
            self._plan = (number, step + 1)
            faults.point("heal.planned")

    def members(self) -> list[int]:
        return list(self.membership.generation.members)

    def where(self) -> dict[str, int]:
        generation = self.membership.generation
        return {"member": generation.member, "generation": generation.number}

    def wrap_logger(self, logger: Logger) -> Logger:
        return FencedLogger(logger, self)

    def dump(self, reason: str) -> None:
        """The flight recorder of the trainer in use now (the heartbeat's watchdog asks for it)."""
        if self.trainer is not None and self.trainer.dump_flight is not None:
            self.trainer.dump_flight(reason)

    def wrap_dump(self, dump):
        if dump is None:
            return None

        def fenced(reason: str) -> None:
            if self.membership.newest() <= self.membership.generation.number:
                dump(reason)

        return fenced

    # --- the machine -------------------------------------------------------------------------------------
    def start(self, build: Callable[[bool], Trainer], prepare: Callable[[Trainer], Any]) -> tuple[Trainer, Any]:
        """Start-up in generation 0, within the heal's reach: ``build(joining)`` the trainer (its strategy's first
        collectives: DDP's broadcast of rank 0's state) and ``prepare`` it (the resume's agreement and load, the
        finished check). A worker lost on the way is healed like one lost in a step: the survivors form the next
        generation, agree on one state, and prepare again in it, so a resume still starts from its checkpoint.
        Returns the trainer (a heal may have rebuilt it) and what ``prepare`` returned."""
        generation = self.membership.generation
        # The launched rank 0 holds the run directory's lock already (train/run.py); a later writer takes it over.
        self._lock = True if generation.rank == 0 else None
        trainer: Trainer | None = None
        self._starting = True
        while True:
            failure = None
            try:
                if trainer is None:
                    trainer = build(False)
                self.trainer = trainer
                step = trainer.state.step
                result = prepare(trainer)
                for record in self.pending:  # healed before the resume loaded: the job goes on from its step
                    if trainer.state.step != step:
                        record.update(step=trainer.state.step + 1, from_step=trainer.state.step)
                self._starting = False
                return trainer, result
            except (Fenced, HealFailed, MemberFailed, Stopped, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # noqa: BLE001 - sorted below, as in run()
                failure = failure_of(err)
                if failure is None:
                    self._say_error(err, self.membership.generation.rank)
                    raise
            # Outside the except block: the failure's frames must not keep the broken group alive.
            if trainer is None:  # the strategy's wrap failed: built again unwrapped (no collective), as a joiner's
                trainer = build(True)
            self.trainer = trainer
            try:
                self._recover(failure)
            except Spared as err:
                return self.trainer, self._spared(err)
            trainer = self.trainer

    def join_replica(self, ctx: DistContext) -> Trainer:
        """A worker admitted with a whole replica of a split model (it holds nothing before its group forms):
        form the group with the running workers, build the trainer on it and receive this rank's part from its
        counterpart in a replica that trained (replicas.py). A failure on the way ends this worker in one line
        (the running workers heal without its replica); ``run`` then trains with the returned trainer."""
        generation = self.membership.generation
        try:
            self.membership.form(ctx.backend)
            self.trainer = move_to_group(None, generation, self.rebuild, ctx)
        except (Fenced, HealFailed, MemberFailed):
            raise
        except BaseException as err:  # noqa: BLE001 - a lost member: this joiner has no state to heal with
            failure = failure_of(err)
            if failure is None:
                raise
            raise HealFailed(f"member {generation.member}: the group failed while its replica was admitted "
                             f"({failure}); it leaves without joining (start ringtrain join again)") from None
        print(f"ringtrain: joined as rank {generation.rank} of {generation.world_size} (generation "
              f"{generation.number}, replica {replica_of(generation.rank, replica_size(self.trainer))}) at step "
              f"{self.trainer.state.step}", file=sys.stderr, flush=True)
        return self.trainer

    def run(self, trainer: Trainer, joining: bool = False) -> dict[str, Any]:
        """Train with ``trainer`` to the end through every failure and admission; returns the summary.
        ``joining``: an admitted worker whose trainer is built but not yet in its group."""
        self.trainer = trainer
        if joining:
            self._has_state = False
            failure = self._settle(self.membership.generation, None)
            if failure is not None:
                self._recover(failure)
            generation = self.membership.generation
            print(f"ringtrain: joined as rank {generation.rank} of {generation.world_size} (generation "
                  f"{generation.number}) at step {self.trainer.state.step}", file=sys.stderr, flush=True)
        self.trainer.start()
        with self.trainer.stop_signal:
            while True:
                failure, admit = None, False
                try:
                    self.trainer.train()
                    summary = self.trainer.finish()
                    self.membership.mark_finished()
                    faults.point("heal.finished")
                    return summary
                except Regroup:
                    admit = True
                except (Fenced, HealFailed, MemberFailed, Stopped, KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as err:  # noqa: BLE001 - sorted below: a lost peer heals, the rest stops all
                    failure = failure_of(err)
                    if failure is None:
                        self._say_error(err)
                        raise
                # Outside the except blocks: the failure's frames must not keep the broken group alive.
                try:
                    if admit:
                        self._admit()
                    if failure is not None:
                        self._recover(failure)
                except Spared as err:
                    return self._spared(err)

    def _spared(self, err: Spared) -> dict[str, Any]:
        """A live member whose replica lost a peer: the others went on without it; it leaves cleanly."""
        print(f"ringtrain: {err}", file=sys.stderr, flush=True)
        self.trainer.close()
        return {"spared": True}

    def _say_error(self, err: BaseException, rank: int | None = None) -> None:
        text = str(err).strip().splitlines()
        line = text[0] if isinstance(err, RingtrainError) and text else f"{type(err).__name__}: {text[0] if text else ''}"
        try:
            self.membership.publish_error(f"[rank {self.trainer.ctx.rank if rank is None else rank}] {line}")
        except Exception:  # noqa: BLE001 - the store is gone too: the error itself is what matters
            pass

    def _leave(self, failed: bool) -> None:
        self.trainer.abandon_saves()
        if failed:  # DiLoCo: back to the last outer step's model, every exchange in flight dropped
            self._inner_steps_dropped = self.trainer.parts.strategy.outer_loop.abandon_interval()
        self.trainer.leave_group()
        abandon_group(failed=failed)

    _inner_steps_dropped: int | None = None
    _starting = False
    """In ``start``: the trainer's records are not open yet (and its step is not the resume's until it loaded)."""

    def _recover(self, failure: str) -> None:
        """Heal until a generation settles (see the module's docstring); raises when healing cannot go on."""
        trainer = self.trainer
        failed_step = trainer.state.step + 1
        started = time.perf_counter()
        if self.buffers is not None:  # the failure came inside a step this rank had not applied
            self.buffers.restore()  # its forwards are undone (BatchNorm statistics)
            self.buffers = None
        size = replica_size(trainer)
        while failure is not None:
            old = self.membership.generation
            self.membership.publish_failure(failed_step)
            self._leave(failed=True)
            generation, finished = self.membership.agree(applied_step=self.trainer.state.step, replica_size=size)
            lost = [m for m in old.members if m not in generation.members]
            record = {
                "type": "heal", "step": failed_step, "generation": generation.number,
                "lost_ranks": [old.members.index(m) for m in lost],
                "remaining_ranks": [old.members.index(m) for m in generation.members if m in old.members],
                "world_size": generation.world_size, "cause": failure,
            }
            if size > 1:  # a split model: whole replicas left (the lost ranks' peers with them)
                left = sorted({replica_of(old.members.index(m), size) for m in lost})
                record["replica"] = left[0] if len(left) == 1 else left
                record["replica_ranks"] = [r for r in range(old.world_size) if replica_of(r, size) in left]
            if self._inner_steps_dropped is not None:  # DiLoCo: each member's inner steps since its last sync
                record["inner_steps_dropped"] = self._inner_steps_dropped
            if self.membership.store.add(f"{generation.number}/counted", 1) == 1:
                self.membership.store.add("heals", 1)  # once per generation, whoever gets here first
            self._check_repeats(lost, failure, failed_step)
            applied = max(self.membership.arrived_steps(old.number).values(), default=self.trainer.state.step)
            self.pending.append(record)
            failure = self._settle(generation, record, finished=finished, started=started, applied=applied)
        if self.trainer.finished:  # no step follows to write them: the heal ends with the group settled
            self.committed(self.trainer.state.step)

    def _check_repeats(self, lost: list[int], failure: str, step: int) -> None:
        self._repeats = 0 if lost else self._repeats + 1
        if self._repeats >= REPEATS_WITHOUT_LOSS:
            raise HealFailed(f"step {step}: the group failed {self._repeats} times in a row with no worker lost ({failure}); "
                             "this is not a lost worker: check the network and dist.timeout_s, then --resume")

    def _settle(self, generation: Generation, record: dict[str, Any] | None, finished: bool = False,
                started: float | None = None, applied: int = 0) -> str | None:
        """Form ``generation``'s group and bring the trainer whole onto it. Returns None when it settled, or the
        line of the failure that broke this generation in turn (the caller heals again)."""
        try:
            faults.context(generation=generation.number, rank=generation.rank)
            faults.point("heal.form")
            self.membership.form(self.trainer.ctx.backend)
            faults.point("heal.settle")
            if self.reloads:
                from ringtrain.heal.reload import reload_shards  # DCP and the rebuild: only sharded jobs

                self.trainer, steps_lost, path = reload_shards(self.trainer, generation, self.rebuild, applied, record)
                if record is not None:
                    record.update(from_step=self.trainer.state.step, steps_lost=steps_lost, reloaded=path)
            elif replica_size(self.trainer) > 1:
                self.trainer = move_to_group(self.trainer, generation, self.rebuild)
                if not self._starting:  # at the start nothing is open yet: ``run`` starts the trainer
                    self.trainer.start()
                    self._fix_ledger()
                if record is not None:
                    record.update(from_step=self.trainer.state.step, rolled_forward=False,
                                  steps_lost=max(0, applied - self.trainer.state.step))
            else:
                position = self.trainer.position if self._has_state else NO_STATE
                source = agree_on_state(position, state_digest(self.trainer.module), self.trainer.transfer_state,
                                        self.trainer.load_transfer_state)
                check_agreed(self.trainer.position, state_digest(self.trainer.module))
                self._has_state = True
                self.trainer.regroup(context_for(self.trainer.ctx, generation))
                if not self._starting:  # at the start nothing is open yet: the trainer's start cuts the ledger
                    self._fix_ledger()
                if record is not None:
                    record.update(from_step=self.trainer.state.step, rolled_forward=source is not None,
                                  steps_lost=max(0, applied - self.trainer.state.step))
        except (Fenced, HealFailed, MemberFailed):
            raise
        except BaseException as err:  # noqa: BLE001 - a failure of this generation heals again; the rest stops all
            failure = failure_of(err)
            if failure is None:
                self._say_error(err)
                raise
            return failure
        if self.trainer.ctx.rank == 0 and self._lock is None:  # this worker became the writer
            self._lock = RunDirLock(self.trainer.config.run_dir).take_over()
        if record is not None:
            record["regroup_s"] = round(time.perf_counter() - started, 3)
            for earlier in self.pending:  # a heal that failed in turn goes on from the same step as this one
                earlier.setdefault("from_step", record["from_step"])
                earlier.setdefault("steps_lost", record["steps_lost"])
            self._below_minimum(generation, record, finished)
        return None

    def _below_minimum(self, generation: Generation, record: dict[str, Any], finished: bool) -> None:
        """Fewer than --min-nproc with steps left: save the step reached (replicated) and end in one line. With
        training done (a member finished, or every step applied) the last evaluation and summary go on."""
        trainer = self.trainer
        if generation.world_size >= self.min_workers or finished or trainer.finished:
            return
        lost, size = record["lost_ranks"], generation.world_size
        who = f"{_ranks(lost)} lost and only" if lost else "only"
        if self.reloads:
            from ringtrain.heal.reload import newest_sharded_checkpoint

            newest = newest_sharded_checkpoint(trainer.checkpoints.directory)
            since = f"continue from {newest.name} with --resume" if newest is not None else (
                "no sharded checkpoint was saved yet: --resume starts over (set a lower checkpoint.every_steps)")
            raise HealFailed(f"step {record['step']}: {who} {size} worker{'s' * (size != 1)} remain, below --min-nproc "
                             f"{self.min_workers}; comm.strategy = '{trainer.parts.strategy.name}' held shards only "
                             f"there, so this step cannot be saved: {since}")
        trainer.save_checkpoint()
        name = trainer.checkpoints.path_for(trainer.state.step).name
        raise HealFailed(f"step {record['step']}: {who} {size} worker{'s' * (size != 1)} remain, below --min-nproc "
                         f"{self.min_workers}: saved {name} (step {trainer.state.step}); continue with --resume")

    def _admit(self) -> None:
        """Regroup with the joining workers at this step boundary. A failure on the way is healed like any other;
        the joiners that are members once the group settled are recorded as joined."""
        started = time.perf_counter()
        _, joiners = self.membership.admission()
        self._plan = None
        self._leave(failed=False)
        self.membership.admit(joiners)
        failure = self._settle(self.membership.generation, None)
        if failure is not None:
            self._recover(failure)
        generation = self.membership.generation
        joined = [generation.members.index(j) for j in joiners if j in generation.members]
        if joined:
            record = {"type": "join", "step": self.trainer.state.step, "generation": generation.number,
                      "joined_ranks": joined, "world_size": generation.world_size}
            size = replica_size(self.trainer)
            if size > 1:  # a split model: the joiners came as whole replicas
                replicas = sorted({replica_of(rank, size) for rank in joined})
                record["replica"] = replicas[0] if len(replicas) == 1 else replicas
                record["replica_ranks"] = joined
            record["admit_s"] = round(time.perf_counter() - started, 3)
            self.trainer.logger.log(record)

    def _fix_ledger(self) -> None:
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
            epoch, cursor, dp_size = self.window_starts[step]
            sampler = trainer.parts.sampler
            window = sampler.order(epoch)[cursor : cursor + sampler.global_batch_size]
            shares = [window[r::dp_size].tolist() for r in range(dp_size)]
            ledger.write(step, epoch, shares, skipped=False)


def context_for(ctx: DistContext, generation: Generation) -> DistContext:
    """``ctx`` for this worker's rank and world size in ``generation``."""
    host_rank, host_world_size = host_placement(ctx.env.bind_addr)
    env = dataclasses.replace(ctx.env, rank=generation.rank, world_size=generation.world_size)
    return dataclasses.replace(ctx, env=env, host_rank=host_rank, host_world_size=host_world_size)


class FencedLogger(Logger):
    """Checks the fence before every write of the writer's loggers (metrics.jsonl, summary.json, console)."""

    def __init__(self, inner: Logger, healing: Supervisor):
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


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
