"""The training loop: read it top to bottom to see the distributed story.

Each optimizer step takes the next window of ``global_batch_size`` samples of the epoch's order; this
rank's share arrives as one StepBatch and is cut into micro-batches. Every micro-batch but the last runs
inside ``strategy.no_sync`` (no all-reduce); the last backward synchronises, so there is exactly one
gradient all-reduce per optimizer step. Losses are summed per item and scaled by
``world_size / items_in_window``, so after the strategy averages over workers the gradient is the mean
over the whole window, exactly as one process would compute it on the full batch.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import Config
from ringtrain.errors import CheckpointError
from ringtrain.data.loader import StepBatch
from ringtrain.data.sampler import ResumableSampler
from ringtrain.dist.group import DistContext
from ringtrain.monitor.loggers import Logger
from ringtrain.monitor.memory import memory_mb
from ringtrain.monitor.metrics import StepClock
from ringtrain.monitor.rank_stats import RankStats, gather_rank_stats
from ringtrain.parallel import Strategy
from ringtrain.train.evaluate import evaluate
from ringtrain.train.state import TrainState
from ringtrain.train.tasks import ClassificationTask

__all__ = ["TrainParts", "Trainer"]


@dataclass
class TrainParts:
    """Everything the trainer works on, built beforehand by ``build_trainer``."""

    model: nn.Module
    """The model as wrapped by the strategy."""
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    sampler: ResumableSampler
    train_loader: DataLoader
    eval_loader: DataLoader
    task: ClassificationTask
    total_steps: int
    """Optimizer steps of the whole run (the lr schedule spans them)."""


class Trainer:
    def __init__(self, config: Config, ctx: DistContext, parts: TrainParts, logger: Logger, checkpoints: CheckpointManager):
        self.config = config
        self.ctx = ctx
        self.parts = parts
        self.model = parts.model
        self.module = parts.strategy.unwrap(parts.model)
        self.comm_timer = parts.strategy.comm_timer
        self.logger = logger
        self.checkpoints = checkpoints
        self.state = TrainState()
        self.clock = StepClock()
        self.micro_batch_size = config.train.local_batch_size
        self.total_steps = parts.total_steps
        self.last_loss = math.nan
        self.last_eval: dict[str, Any] = {}

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    # --- what a checkpoint holds -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.parts.optimizer.state_dict(),
            "scheduler": self.parts.scheduler.state_dict(),
            "sampler": self.parts.sampler.state_dict(),
            "train_state": self.state.state_dict(),
            "config_digest": self.config.digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.parts.optimizer.load_state_dict(state["optimizer"])
        self.parts.scheduler.load_state_dict(state["scheduler"])
        self.parts.sampler.load_state_dict(state["sampler"])
        self.state.load_state_dict(state["train_state"])

    def resume(self, required: bool) -> Path | None:
        """Load the latest checkpoint; with none, start fresh unless ``required`` (an explicit --resume)."""
        path = self.checkpoints.latest()
        if path is None:
            if required:
                raise CheckpointError(
                    f"--resume: no checkpoint in {self.checkpoints.directory}; run without --resume to start"
                )
            return None
        self.load_state_dict(self.checkpoints.load(path))
        return path

    # --- the loop ------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``, evaluate, checkpoint, and return the run's summary."""
        sampler = self.parts.sampler
        self.logger.start(self.total_steps, self.state.step, sampler.steps_per_epoch)
        start = time.perf_counter()
        start_samples = self.state.samples_seen
        self.clock = StepClock()
        while not self.finished:
            batches = iter(self.parts.train_loader)  # the rest of this epoch, from the sampler's cursor
            while not self.finished:
                with self.clock.phase("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                self.train_step(batch)
                if sampler.epoch_finished:
                    self._end_epoch()
                with self.clock.phase("monitor"):
                    self.logger.on_step(self.state.step, self.state.epoch)
                self._maybe_log()
                self._maybe_checkpoint()
        wall_s = time.perf_counter() - start
        self.last_eval = self._evaluate()
        self._save_checkpoint()
        summary = self._summary(wall_s, self.state.samples_seen - start_samples)
        self.logger.finish(summary)
        return summary

    def train_step(self, batch: StepBatch) -> None:
        """One optimizer step on this rank's share of the next window."""
        world_size = self.ctx.world_size
        window = self.parts.sampler.next_window_size()
        # Same micro-batch count on every rank (each forward/backward may run collectives).
        micro_count = max(1, math.ceil(math.ceil(window / world_size) / self.micro_batch_size))
        loss_scale = world_size / window
        with self.clock.phase("data"):
            micro_batches = batch.to(self.ctx.device).micro_batches(micro_count)
        loss_sum = torch.zeros((), device=self.ctx.device)
        with self.clock.phase("forward_backward"):
            for index, (inputs, targets) in enumerate(micro_batches):
                is_last = index == len(micro_batches) - 1
                # Accumulation micro-steps skip gradient sync; only the last backward all-reduces.
                with nullcontext() if is_last else self.parts.strategy.no_sync(self.model):
                    loss = self.parts.task.loss_sum(self.model(inputs), targets)
                    (loss * loss_scale).backward()
                loss_sum += loss.detach()
        # Backward included the wait for the gradient all-reduce; book that part as communication.
        self.clock.move("forward_backward", "comm_exposed", self.comm_timer.backward_done())
        with self.clock.phase("optimizer"):
            if self.config.train.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip_norm)
            self.parts.optimizer.step()
            self.parts.scheduler.step()
            self.parts.optimizer.zero_grad(set_to_none=True)
        self.parts.sampler.advance()
        self.state.step += 1
        self.state.samples_seen += window
        self.clock.end_step(window)
        self.comm_timer.end_step()
        self._step_loss = (loss_sum, window)

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.parts.sampler.set_epoch(self.state.epoch)
        every = self.config.monitor.eval_every_epochs
        if every and self.state.epoch % every == 0 and not self.finished:
            with self.clock.phase("eval"):
                self.last_eval = self._evaluate()

    def _maybe_log(self) -> None:
        if self.state.step % self.config.monitor.log_every_steps and not self.finished:
            return
        # The interval ends here; the cost of this record is booked in the next one.
        timing = self.clock.flush()
        with self.clock.phase("monitor"):
            memory = memory_mb(self.ctx.device)
        loss_sum, window = self._step_loss
        busy_s = timing.get("time/data_s", 0.0) + timing.get("time/forward_backward_s", 0.0)
        # Every rank takes part in this collective; only rank 0's logger writes the record. It waits for
        # the slowest rank like the gradient all-reduce would, so it is booked as exposed communication.
        with self.clock.phase("comm_exposed"):
            ranks = gather_rank_stats(loss_sum.item(), busy_s, memory["memory/peak_rss_mb"])
        with self.clock.phase("monitor"):
            self._log_train_record(timing, memory, ranks, window)

    def _log_train_record(self, timing: dict, memory: dict, ranks: RankStats, window: int) -> None:
        self.last_loss = ranks.loss_sum / window
        record = {
            "type": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": self.last_loss,
            "lr": self.parts.scheduler.get_last_lr()[0],
            **timing,
            **self.comm_timer.flush(),
            "comm_fraction": timing.get("time/comm_exposed_s", 0.0) / timing["step_time_s"],
            **memory,
            "memory/peak_rss_mb": ranks.peak_rss_mb,
            "straggler/rank": ranks.slowest_rank,
            "straggler/lag_s": ranks.lag_s,
        }
        self.logger.log(record)

    def _maybe_checkpoint(self) -> None:
        if self.state.step % self.config.checkpoint.every_steps == 0 and not self.finished:
            with self.clock.phase("checkpoint"):
                self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        self.checkpoints.save(self.state.step, self.state_dict())

    def _evaluate(self) -> dict[str, Any]:
        metrics = evaluate(self.module, self.parts.eval_loader, self.parts.task, self.ctx.device)
        self.logger.log({"type": "eval", "step": self.state.step, "epoch": self.state.epoch, **metrics})
        return metrics

    def _summary(self, wall_s: float, samples: int) -> dict[str, Any]:
        return {
            "world_size": self.ctx.world_size,
            "steps": self.state.step,
            "epochs": round(self.state.samples_seen / self.parts.sampler.num_samples, 3),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(samples / wall_s, 1) if wall_s > 0 else 0.0,
            "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "eval": {k: v for k, v in self.last_eval.items() if k != "count"},
        }
