"""The training loop: read it top to bottom to see the distributed story.

Each optimizer step takes the next window of ``global_batch_size`` samples of the epoch's order; this
rank's share arrives as one StepBatch. ``GradientStep`` (train/step.py) cuts it into micro-batches (a
fixed size, or a token budget for text), accumulates their gradients with one all-reduce on the last
backward, and normalises losses by the window's global item count, so the gradient equals the full
batch's.

One small all-reduce (``StepGuard.start``, run beside the synchronising backward) tells every rank whether
any rank saw a non-finite loss (then all skip the update) or a stop signal (then all checkpoint and exit);
a non-finite gradient is seen by every rank alike after synchronisation (``StepGuard.finish``).
Collectives run under ``CollectiveWatch``, so a dead or stopped peer becomes one line naming the rank, the
operation and the step. Every part of a step is booked in a ``StepClock`` phase for the breakdown.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ringtrain.checkpoint.front import CheckpointFront, Found, Stateful
from ringtrain.checkpoint.manager import checkpoint_step
from ringtrain.checkpoint.sharded import PendingSave
from ringtrain.config import Config
from ringtrain.data.ledger import build_ledger
from ringtrain.data.loader import StepBatch
from ringtrain.data.seeding import STEP_STREAM, derive_seed, seed_everything
from ringtrain.dist.group import DistContext, host_placement
from ringtrain.dist.jobstore import PreviousAttempt
from ringtrain.dist.watch import CollectiveWatch, first_line, flight_dumper
from ringtrain.errors import CheckpointError
from ringtrain.monitor.loggers import Logger, build_logger
from ringtrain.monitor.memory import memory_mb
from ringtrain.monitor.metrics import StepClock, model_flops_utilization
from ringtrain.monitor.rank_stats import RankStats, gather_rank_stats
from ringtrain.parallel import build_strategy
from ringtrain.testing import faults
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.train.commit import StepCommit
from ringtrain.train.evaluate import evaluate
from ringtrain.train.guards import StepGuard, Stopped, StopSignal, Verdict, check_every_parameter_has_a_gradient, check_replicas
from ringtrain.train.healing_hooks import NoHealing
from ringtrain.train.parts import TrainParts
from ringtrain.train.resume import ResumePlan, check_same_choice, resume_record
from ringtrain.train.state import TrainState
from ringtrain.train.stateful import CommState, ModelState, OptimizerState, RunInfo, ScheduleState, ShardedTensors
from ringtrain.train.step import GradientStep

__all__ = ["TrainParts", "Trainer"]  # TrainParts re-exported: builders import it from here


class Trainer:
    def __init__(self, config: Config, ctx: DistContext, parts: TrainParts, logger: Logger,
                 healing: NoHealing | None = None):
        self.config = config
        self.ctx = ctx
        self.parts = parts
        self.healing: NoHealing = healing or NoHealing()
        """Under ``[dist] heal``: the seams healing needs (ringtrain/heal/); else nothing."""
        self.module = parts.module
        self.logger = self.healing.wrap_logger(logger)
        self.state = TrainState()
        self.clock = StepClock()
        self.precision = parts.precision
        self.total_steps = parts.total_steps
        self.tokens_seen = 0
        self.last_loss = math.nan
        self.last_eval: dict[str, Any] = {}
        self.eval_due = False
        """An epoch ended and its evaluation has not run yet (a heal in between runs it again)."""
        self.final_eval_done = False
        """The last evaluation ran (a heal inside the last summary does not run it again)."""
        self.stop_signal = StopSignal()
        self.notices: list[dict[str, Any]] = []
        """Records of the resume (warnings, the restart report), logged once training starts."""
        self.previous = PreviousAttempt(starts=1, last_step=None, last_step_time=None)
        self._saved_step = -1
        self.checkpoints = self._checkpoint_front()
        """Every checkpoint of the run, full or sharded (checkpoint/front.py); only rank 0 writes full ones."""
        self._pending_save: PendingSave | None = None
        self._gradients_checked = False
        self._state_mb = 0.0
        """The largest model state (MB) measured after a step's update, before its gradients are dropped."""
        self._started: tuple[float, int] | None = None
        """(perf_counter, samples_seen) when training started."""
        self._wall_s: float | None = None
        self._bind_group()

    def _bind_group(self) -> None:
        """What works through the process group and is made here, not by the builder (the group's rank and size)."""
        ctx, parts, config = self.ctx, self.parts, self.config
        self.model = parts.model
        self.comm_timer = parts.strategy.comm_timer
        self.batcher = parts.batcher
        self.gradient = GradientStep(parts, self.clock, ctx.world_size, ctx.device)
        dump = flight_dumper(config.run_dir, ctx.rank, ctx.world_size) if config.dist.flight_recorder else None
        self.dump_flight = self.healing.wrap_dump(dump)
        self.watch = CollectiveWatch(parts.job_store, ctx.rank, ctx.world_size, config.dist.timeout_s,
                                     interval_s=self.healing.beat_s, on_failure=self.dump_flight,
                                     members=self.healing.members())
        self.guard = StepGuard(ctx.rank, ctx.world_size, ctx.device,
                               config.train.max_consecutive_nonfinite_steps, self.stop_signal)
        self.commit = StepCommit(parts.strategy, parts.model, parts.optimizer, self.precision, self.guard, self.watch,
                                 self.clock, parts.ledger, parts.sampler, self.state, parts.job_store,
                                 config.train.grad_clip_norm, fence=self.healing.check_fence)

    # --- the group this trainer works in (healing moves it from one group to the next) ------------------
    def leave_group(self) -> None:
        """Drop everything that hangs off the current process group (a DDP reducer's hooks would fire on the
        next backward); the module, optimizer and the rest of the state stay."""
        strategy = self.parts.strategy
        if self.parts.model is not self.module:
            try:
                strategy.unwrap(self.parts.model, release=True)  # manual: its hooks and buckets go
            except TypeError:
                strategy.unwrap(self.parts.model)
        for param in self.module.parameters():
            param.grad = None
        self.parts.model = self.model = self.module
        self.gradient.model = self.module
        self.module.train()  # a failure inside evaluation left it in eval mode

    def regroup(self, ctx: DistContext) -> None:
        """Rebuild what depends on the group, the rank or the world size for the group of ``ctx``: the strategy
        around the same module, the step loader (the rest of the epoch dealt over the new group), the
        micro-batch plan, guard and watch, and the writer's files when rank 0 changed hands. The module,
        optimizer, sampler and counters are kept."""
        config, parts = self.config, self.parts
        host_rank, host_world_size = host_placement(ctx.env.bind_addr)
        ctx = dataclasses.replace(ctx, host_rank=host_rank, host_world_size=host_world_size)
        old_rank, self.ctx = self.ctx.rank, ctx
        was_writer = old_rank == 0
        parts.strategy = build_strategy(config.comm, ctx.device)
        parts.model = parts.strategy.wrap(self.module)  # DDP broadcasts rank 0's state: the same everywhere already
        parts.train_loader, parts.eval_loader = parts.loaders(ctx.rank, ctx.world_size)
        batcher = MicroBatcher(config.train, parts.task, ctx.rank, ctx.world_size, ctx.device)
        batcher.load_state_dict(parts.batcher.state_dict())
        parts.batcher = batcher
        parts.job_store.is_writer = ctx.rank == 0
        if ctx.rank == 0 and not was_writer:  # rank 0 was lost: this worker takes over the run directory's files
            logger = build_logger(config, 0, config.run_dir)
            logger.start(self.total_steps, self.state.step, parts.sampler.steps_per_epoch)
            self.logger = self.healing.wrap_logger(logger)
            self.checkpoints = self._checkpoint_front()
            parts.ledger = build_ledger(config.data.ledger, config.run_dir, parts.sampler.num_samples, 0)
            parts.ledger.start(self.state.step)
            print(f"ringtrain: rank {old_rank} is now rank 0 and writes the run directory", file=sys.stderr, flush=True)
        self._bind_group()

    def abandon_saves(self) -> None:
        """The group failed: a background sharded save in flight must not commit any more."""
        self._pending_save = None
        self.checkpoints.abandon()

    def close(self) -> None:
        """End this trainer's files and threads; another one goes on instead."""
        self.parts.ledger.close()
        self.logger.close()
        self.end_threads()

    def end_threads(self) -> None:
        """End the strategy's threads (zero3's communication thread): a finished worker joins every thread."""
        close = getattr(self.parts.strategy, "close", None)
        if close is not None:
            close()

    def carry_over(self, old: Trainer) -> None:
        """Go on where ``old`` (built for a group that failed) left off: its start, its signals, its restarts."""
        self.previous, self._started = old.previous, old._started
        self.stop_signal = old.stop_signal  # installed by whoever drives the training
        self._bind_group()

    # --- what a transfer between members holds (ringtrain/heal/transfer.py) ----------------------------
    @property
    def position(self) -> tuple[int, int]:
        """Where training stands, for comparing members: (step applied, evaluations of that step done)."""
        return self.state.step, int(not self.eval_due) + int(self.final_eval_done)

    def transfer_state(self) -> dict[str, Any]:
        """What a member that is behind receives: the checkpoint's parts (the module and optimizer as this process
        holds them, out of any group) and the evaluations' progress. Tensors and plain values only."""
        parts = self.checkpoint_parts(local=True)
        return {**{name: part.state_dict() for name, part in parts.items() if name != "comm"},
                "progress": {"eval_due": self.eval_due, "final_eval_done": self.final_eval_done,
                             "last_eval": dict(self.last_eval)}}

    def load_transfer_state(self, state: dict[str, Any]) -> None:
        for name, part in self.checkpoint_parts(local=True).items():
            if name in state:
                part.load_state_dict(state[name])
        self.eval_due = bool(state["progress"]["eval_due"])
        self.final_eval_done = bool(state["progress"]["final_eval_done"])
        self.last_eval = dict(state["progress"]["last_eval"])

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    # --- what a checkpoint holds: named once, for saves, loads and the heal's transfer ------------------
    def checkpoint_parts(self, local: bool = False) -> dict[str, Stateful]:
        """The stateful parts a checkpoint holds, in load order (the run's facts first: the optimizer's class is
        checked before its state is loaded; the schedule after the step it is positioned at). No generator state:
        randomness is derived from (seed, epoch, sample) and (seed, step, rank) (``data/seeding.py``).
        ``local``: the model and optimizer as this process holds them, outside any group (a heal's transfer)."""
        parts = self.parts
        strategy = None if local else parts.strategy
        self._run_info = RunInfo(self.config, parts.optimizer, self.ctx.world_size)
        return {"run": self._run_info, "model": ModelState(strategy, self.model),
                "optimizer": OptimizerState(strategy, parts.optimizer), "sampler": parts.sampler,
                "train_state": self.state, "schedule": ScheduleState(parts.scheduler, self.state),
                "precision": self.precision, "micro_batch": self.batcher,
                "comm": CommState(strategy, self.ctx.rank, self.ctx.world_size, self._warn)}

    def _tensors(self) -> ShardedTensors:
        return ShardedTensors(self.parts.strategy, self.model, self.parts.optimizer)

    def _checkpoint_front(self) -> CheckpointFront:
        ckpt = self.config.checkpoint
        return CheckpointFront(Path(self.config.run_dir) / ckpt.dir, self.ctx.rank, self.ctx.world_size, ckpt.keep_last,
                               sharded=ckpt.sharded, background=ckpt.async_, fence=self.healing.check_fence,
                               new_group=self.healing.new_group)

    def resume(self, plan: ResumePlan) -> Path | None:
        """Called once before training on every start: continue from the checkpoint the plan picks (the run's
        newest that verifies, else --resume-from's; every rank picks the same), or return None to start fresh."""
        self.previous = self.parts.job_store.begin_attempt()
        found = self.checkpoints.newest(self._warn) if plan.resume else None
        if found is None and plan.resume and plan.source is not None:
            found = Found(plan.source, checkpoint_step(plan.source) or 0, sharded=False)
        check_same_choice(-1 if found is None else found.step)
        if found is None:
            if plan.required:
                raise CheckpointError(f"--resume: no valid checkpoint in {self.checkpoints.directory}; run without "
                                      "--resume to start afresh")
            if self.previous.last_step is not None:  # a restart before the first checkpoint: start over
                self.notices.append(resume_record(None, 0, self.ctx.world_size, self.previous))
            return None
        self.load_checkpoint(found)
        record = resume_record(found.path, self.state.step, self.ctx.world_size, self.previous)
        record["lr"] = self.parts.scheduler.get_last_lr()[0]
        self.notices.append(record)
        return found.path

    def load_checkpoint(self, found: Found) -> None:
        """Load ``found`` into every part; a checkpoint that does not fit is one line (with the config fields
        that changed since it was saved)."""
        parts = self.checkpoint_parts()
        try:
            self.checkpoints.load(found, parts, self._tensors())
        except (RuntimeError, ValueError, KeyError, CheckpointError) as err:
            changed = self._run_info.changes
            differs = f"; its config differs: {'; '.join(changed)}" if changed else ""
            raise CheckpointError(f"checkpoint {found.path} does not fit this job ({first_line(str(err))}){differs}") from None
        if self._run_info.changes:
            lr = self.parts.scheduler.get_last_lr()[0]
            self._warn(f"resuming {found.path.name} with a changed config: {'; '.join(self._run_info.changes)}; the "
                       f"optimizer's hyperparameters and lr schedule follow it: lr {lr:.6g} at step {self.state.step}")

    def _warn(self, message: str) -> None:
        # Kept until fit() starts the loggers; rank 0's console shows them, metrics.jsonl records them.
        self.notices.append({"type": "warning", "message": message})

    # --- the loop ------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``, evaluate, checkpoint, and return the run's summary."""
        self.start()
        with self.stop_signal:
            self.train()
        return self.finish()

    def start(self) -> None:
        """Open the run's records (once): loggers, the notices of the resume, the ledger cut back to this step."""
        sampler = self.parts.sampler
        self.logger.start(self.total_steps, self.state.step, sampler.steps_per_epoch)
        self._log_notices()
        # The ledger keeps the history of the weights we resumed: steps redone after a crash appear once.
        self.parts.ledger.start(self.state.step)
        if self._started is None:  # a trainer rebuilt by a heal goes on with its predecessor's (carry_over)
            self._started = (time.perf_counter(), self.state.samples_seen)
        self.tokens_seen = 0
        self.clock.flush()  # start the first interval now

    def train(self) -> None:
        """Train to ``total_steps``. Re-entrant: after a heal (or an admission) it goes on from the step the
        members agreed on, with a fresh iterator (the rest of the epoch dealt over the new group)."""
        sampler = self.parts.sampler
        while not self.finished:
            if self.eval_due:
                self._evaluate_epoch()
            batches = iter(self.parts.train_loader)  # the rest of this epoch, from the sampler's cursor
            while not self.finished:
                self.healing.at_boundary()  # under --heal: a worker may join here (it raises to regroup)
                with self.clock.phase("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                self.healing.begin_step()
                verdict = self.train_step(batch)
                if sampler.epoch_finished:
                    self._end_epoch()
                with self.clock.phase("monitor"):
                    self.logger.on_step(self.state.step, self.state.epoch)
                    self._log_restart_once()
                self._maybe_log()
                self._maybe_checkpoint()
                if verdict.stop:
                    self._stop()

    def finish(self) -> dict[str, Any]:
        """Evaluate, save the last step, and return the summary. Re-entrant: every member runs it whole again
        after a heal (the same collectives in the same order); the last save is made once per writer."""
        if self._wall_s is None:
            self._wall_s = time.perf_counter() - self._started[0]
        if not self.final_eval_done:
            self.last_eval = self._evaluate()
            self.final_eval_done = True
        if self._saved_step != self.state.step:
            self._save_checkpoint()
        self._finish_save()
        faults.point("train.finish")
        summary = self._summary(self._wall_s, self.state.samples_seen - self._started[1])
        self.parts.ledger.close()
        self.logger.finish(summary)
        return summary

    def train_step(self, batch: StepBatch) -> Verdict:
        """One optimizer step on this rank's share of the next window (skipped on every rank when any
        rank's loss or gradient is not finite)."""
        step = self.state.step + 1
        faults.context(step=step, rank=self.ctx.rank)  # where a test's fault plan is matched (nothing unarmed)
        window = self.parts.sampler.next_window_size()
        # The model's randomness (dropout) from (seed, step, rank): distinct per rank, and the same after a
        # resume, without carrying generator state.
        seed_everything(derive_seed(STEP_STREAM, self.config.train.seed, step, self.ctx.rank))
        with self.clock.phase("data"):
            batch = batch.to(self.ctx.device)
        # One small all-reduce: did any rank see a non-finite loss (all skip) or a stop signal? Started just
        # before the synchronising backward, so it runs beside it (a recoverable step runs it afterwards).
        # Sharded gradients differ per rank: then the gradient's flag joins the agreement after the backward.
        strategy, pending = self.parts.strategy, []
        start = (lambda loss: pending.append(self.guard.start(loss))) if strategy.gradients_replicated else None
        with self.watch.op("all_reduce (DDP gradient sync)", step):
            loss_sum, items = self.gradient.run(batch, window, step, on_shrink=self.logger.log, before_sync=start)
        if not self._gradients_checked and strategy.gradients_replicated:
            check_every_parameter_has_a_gradient(self.module, step)
            self._gradients_checked = True
        commit = self.commit
        verdict = commit.verdict(step, loss_sum, pending[0] if pending else None)
        commit.apply(step, verdict, batch.indices.tolist(), self.parts.scheduler, after_update=self._measure_state)
        tokens = 0 if self.parts.task.items_are_samples else items
        commit.advance(step, window, tokens)
        self.tokens_seen += tokens
        self.comm_timer.end_step()
        self._step_loss = (loss_sum, items)
        self.healing.committed(step)
        if verdict.skip:
            self.logger.log({"type": "skip", "step": step, "reason": verdict.describe()})
        self.guard.count(verdict, self.state, step)
        return verdict

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.parts.sampler.set_epoch(self.state.epoch)
        every = self.config.monitor.eval_every_epochs
        if every and self.state.epoch % every == 0 and not self.finished:
            self.eval_due = True
            self._evaluate_epoch()

    def _evaluate_epoch(self) -> None:
        with self.clock.phase("eval"):
            self.last_eval = self._evaluate()
        self.eval_due = False

    def _maybe_log(self) -> None:
        if self.state.step % self.config.monitor.log_every_steps and not self.finished:
            return
        # The interval ends here; the cost of this record is booked in the next one.
        timing = self.clock.flush()
        with self.clock.phase("monitor"):
            memory = memory_mb(self.ctx.device)
        loss_sum, items = self._step_loss
        busy_s = timing.get("time/data_s", 0.0) + timing.get("time/forward_backward_s", 0.0)
        # Every rank takes part in this collective; only rank 0's logger writes the record. It waits for
        # the slowest rank like the gradient all-reduce would, so it is booked as exposed communication.
        with self.clock.phase("comm_exposed"), self.watch.op("all_gather (metrics of every rank)", self.state.step):
            ranks = gather_rank_stats(loss_sum.item(), busy_s, memory["memory/peak_rss_mb"], self._state_mb)
        with self.clock.phase("monitor"):
            self._log_train_record(timing, memory, ranks, items)

    def _log_train_record(self, timing: dict, memory: dict, ranks: RankStats, items: int) -> None:
        self.last_loss = ranks.loss_sum / items
        record = {
            "type": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": self.last_loss,
            **self.parts.task.train_metrics(self.last_loss),
            "lr": self.parts.scheduler.get_last_lr()[0],
            **timing,
            **self.comm_timer.flush(),
            "comm_fraction": timing.get("time/comm_exposed_s", 0.0) / timing["step_time_s"],
            **memory,
            "memory/peak_rss_mb": ranks.peak_rss_mb,
            "model_state_mb": ranks.model_state_mb,
            "straggler/rank": ranks.slowest_rank,
            "straggler/lag_s": ranks.lag_s,
        }
        record.update(self._utilization(record.get("tokens_per_s")))
        self.logger.log(record)

    def _maybe_checkpoint(self) -> None:
        if self._pending_save is not None and self._pending_save.done():
            self._finish_save()
        if self.state.step % self.config.checkpoint.every_steps == 0 and not self.finished:
            with self.clock.phase("checkpoint"):
                self._save_checkpoint()

    def save_checkpoint(self) -> None:
        """Checkpoint the step reached now (every rank calls it; the writer writes)."""
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        self.healing.check_fence()  # a worker cut off from the group writes nothing
        self._finish_save()  # at most one background save in flight
        self._pending_save = self.checkpoints.save(self.state.step, self.checkpoint_parts(), self._tensors(),
                                                   config_sha256=self.config.digest())
        if not self.config.checkpoint.async_:
            self._finish_save()
        self._saved_step = self.state.step

    def _finish_save(self) -> None:
        """Wait for the sharded save in flight (if any) and record it: one 'checkpoint' record per save."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        report = pending.result(timeout=self.config.dist.timeout_s + 600)
        self.logger.log({"type": "checkpoint", "step": report.step, "path": Path(report.path).name, "sharded": True,
                         "async": self.config.checkpoint.async_, "blocked_s": report.blocked_s,
                         "background_s": report.background_s, "bytes": report.bytes})

    def _stop(self) -> None:
        """A rank got SIGTERM or SIGINT: every rank checkpoints this step and exits; nothing is lost."""
        if self._saved_step != self.state.step:
            self._save_checkpoint()
        self._finish_save()  # committed before we say so
        # A peer's signal stopped us; our own agent usually sends us one too (it restarts every worker). Wait
        # for it briefly, so the agent sees a worker it stopped, not one that failed on its own.
        own = self.stop_signal.wait(timeout_s=5.0)
        name = self.checkpoints.path_for(self.state.step).name
        number = self.stop_signal.signal_number or signal.SIGTERM
        who = "this worker" if own else "a peer"
        raise Stopped(f"stopped at step {self.state.step} after saving {name} ({signal.Signals(number).name} to "
                      f"{who}); training continues from there (--resume)", signal_number=number)

    def _log_notices(self) -> None:
        for record in self.notices:
            if record["type"] != "resume":
                self.logger.log(record)

    def _log_restart_once(self) -> None:
        """The resume record goes out after the first step, with the time it took to train again."""
        resumed = [r for r in self.notices if r["type"] == "resume"]
        if not resumed:
            return
        self.notices = [r for r in self.notices if r["type"] != "resume"]
        record = resumed[0]
        last = record.pop("last_step_time", None)
        if last is not None:
            record["restart_s"] = round(time.time() - last, 2)
            self.parts.job_store.add_steps_lost(record["steps_lost"])
        self.logger.log(record)

    def _evaluate(self) -> dict[str, Any]:
        if self.parts.eval_loader is None:
            return {}
        faults.point("train.evaluate")
        with self.watch.op("all_reduce (evaluation sums)", self.state.step):
            metrics = evaluate(
                self.module, self.parts.eval_loader, self.parts.task, self.ctx.device, self.precision.autocast,
                self.parts.metrics, collective_forward=self.parts.strategy.forward_is_collective,
            )
        self.logger.log({"type": "eval", "step": self.state.step, "epoch": self.state.epoch, **metrics})
        return metrics

    def _measure_state(self) -> None:
        """Model state at its fullest (gradients still held after the update): the interval's largest is logged."""
        self._state_mb = max(self._state_mb, self._model_state_mb())

    def _model_state_mb(self) -> float:
        """This rank's unique storage of parameters, gradients, optimizer state and strategy buffers."""
        return self.parts.strategy.model_state_bytes(self.model, self.parts.optimizer) / 2**20

    def _utilization(self, tokens_per_s: float | None) -> dict[str, float]:
        """MFU of a language model, when the config names the device's peak."""
        flops_per_token = getattr(self.module, "flops_per_token", None)
        peak_tflops = self.config.monitor.peak_tflops
        if tokens_per_s is None or flops_per_token is None or peak_tflops is None:
            return {}
        return {"mfu": model_flops_utilization(tokens_per_s, flops_per_token(), self.ctx.world_size, peak_tflops)}

    def _summary(self, wall_s: float, samples: int) -> dict[str, Any]:
        with self.watch.op("all_gather (parameter digests)", self.state.step):
            digests = check_replicas(self.parts.strategy.full_named_parameters(self.model), self.state.step)
            model_state_mb = gather_rank_stats(0.0, 0.0, 0.0, max(self._state_mb, self._model_state_mb())).model_state_mb
        summary = {
            "world_size": self.ctx.world_size,
            "steps": self.state.step,
            "epochs": round(self.state.samples_seen / self.parts.sampler.num_samples, 3),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(samples / wall_s, 1) if wall_s > 0 else 0.0,
            "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "eval": {k: v for k, v in self.last_eval.items() if k != "count"},
            "micro_batch_size": self.batcher.micro_batch_size,
            "restarts": self.previous.starts - 1,
            "heals": self.healing.count,
            "steps_lost": self.parts.job_store.steps_lost(),
            "skipped_steps": self.state.skipped_steps,
            "param_sha256": digests,
            "model_state_mb": model_state_mb,
        }
        if self.tokens_seen and wall_s > 0:
            summary["tokens_per_s"] = round(self.tokens_seen / wall_s, 1)
            summary.update(self._utilization(self.tokens_seen / wall_s))
        if self.parts.data_stats:
            summary["data"] = self.parts.data_stats
        return summary
