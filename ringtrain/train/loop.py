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

The trainer's other concerns are its own methods in files of their own: its process group and what healing
moves to the next one (``loop_group.py``), its checkpoints (``loop_checkpoints.py``), its records and summary
(``loop_records.py``). A step is committed by ``train/commit.py``, which ``ringtrain.Session`` shares.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ringtrain.checkpoint.sharded import PendingSave
from ringtrain.config import Config
from ringtrain.data.loader import StepBatch
from ringtrain.data.seeding import STEP_STREAM, derive_seed, seed_everything
from ringtrain.group.init import DistContext
from ringtrain.group.jobstore import PreviousAttempt
from ringtrain.monitor.loggers import Logger
from ringtrain.monitor.metrics import StepClock
from ringtrain.testing import faults
from ringtrain.train.evaluate import evaluate
from ringtrain.train.guards import StopSignal, Verdict, check_every_parameter_has_a_gradient
from ringtrain.train.healing_hooks import NoHealing
from ringtrain.train.loop_checkpoints import CheckpointSeams
from ringtrain.train.loop_group import GroupSeams
from ringtrain.train.loop_records import RecordKeeping
from ringtrain.train.parts import TrainParts
from ringtrain.train.state import TrainState

__all__ = ["TrainParts", "Trainer"]  # TrainParts re-exported: builders import it from here


class Trainer(GroupSeams, CheckpointSeams, RecordKeeping):
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
        self.stop_signal = StopSignal(absorb_after_stop=True)  # a stop ends this worker (guards.py)
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

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

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
        # (The data-parallel rank: the ranks of one tensor-parallel group drop the same replicated activations.)
        seed_everything(derive_seed(STEP_STREAM, self.config.train.seed, step, self.ctx.dp_rank))
        with self.clock.phase("data"):
            batch = batch.to(self.ctx.device)
        # One small all-reduce: did any rank see a non-finite loss (all skip) or a stop signal? Started just
        # before the synchronising backward, so it runs beside it (a recoverable step runs it afterwards).
        # Sharded gradients differ per rank: then the gradient's flag joins the agreement after the backward.
        strategy, pending = self.parts.strategy, []
        start = (lambda loss: pending.append(self.guard.start(loss))) if strategy.gradients_replicated else None
        with self.watch.op(strategy.step_operation, step):
            loss_sum, items = self.gradient.run(batch, window, step, on_shrink=self.logger.log, before_sync=start)
        if not self._gradients_checked and strategy.gradients_replicated:
            check_every_parameter_has_a_gradient(self.module, step)
            self._gradients_checked = True
        commit = self.commit
        verdict = commit.verdict(step, loss_sum, pending[0] if pending else None)
        commit.apply(step, verdict, batch.indices.tolist(), self.parts.scheduler, after_update=self._measure_state,
                     last=step == self.total_steps)
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

    def _maybe_checkpoint(self) -> None:
        if self._pending_save is not None and self._pending_save.done():
            self._finish_save()
        if self.state.step % self.config.checkpoint.every_steps == 0 and not self.finished:
            with self.clock.phase("checkpoint"):
                self._save_checkpoint()

    def _evaluate(self) -> dict[str, Any]:
        if self.parts.eval_loader is None:
            return {}
        faults.point("train.evaluate")
        # DiLoCo between outer steps: the global model is scored, not each worker's own.
        with self.watch.op("all_reduce (evaluation sums)", self.state.step), self.parts.strategy.outer_loop.evaluation_weights():
            strategy = self.parts.strategy
            pipelined = strategy.pipelined  # its last stages hold the sums: add over all ranks
            metrics = evaluate(
                self.module, self.parts.eval_loader, self.parts.task, self.ctx.device, self.precision.autocast,
                self.parts.metrics, collective_forward=strategy.forward_is_collective,
                group=None if pipelined else self.ctx.dp_group, forward=strategy.forward if pipelined else None,
                loss_context=strategy.loss_context,
            )
            # [train] keep_best: every rank judges the same metrics; the weights are gathered here (DiLoCo's global ones).
            self.parts.best.consider(metrics, self.state.step, self.state.epoch,
                                     lambda: strategy.model_state_dict(self.model))
        self.logger.log({"type": "eval", "step": self.state.step, "epoch": self.state.epoch, **metrics})
        return metrics

    def _measure_state(self) -> None:
        """Model state at its fullest (gradients still held after the update): the interval's largest is logged."""
        self._state_mb = max(self._state_mb, self._model_state_mb())

    def _model_state_mb(self) -> float:
        """This rank's unique storage of parameters, gradients, optimizer state and strategy buffers."""
        return self.parts.strategy.model_state_bytes(self.model, self.parts.optimizer) / 2**20

