"""The training loop: read it top to bottom to see the distributed story.

Each optimizer step takes the next window of ``global_batch_size`` samples of the epoch's order; this
rank's share arrives as one StepBatch and is cut into micro-batches (``MicroBatcher``: a fixed size, or
a token budget for text). Every micro-batch but the last runs inside ``strategy.no_sync`` (no
all-reduce); the last backward synchronises, so there is exactly one gradient all-reduce per optimizer
step. Losses are summed per item (sample or token) and scaled by ``world_size / items_in_window``, so
after the strategy averages over workers the gradient is the mean over the whole window, exactly as one
process would compute it on the full batch.

With ``train.auto_micro_batch`` a step survives running out of memory: see ``_forward_backward``.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
from ringtrain.monitor.metrics import StepClock
from ringtrain.parallel import Strategy
from ringtrain.monitor.metrics import model_flops_utilization
from ringtrain.train.batch_size import OUT_OF_MEMORY, BufferSnapshot, MicroBatcher, StepPlan
from ringtrain.train.evaluate import evaluate
from ringtrain.train.precision import Precision
from ringtrain.train.state import TrainState
from ringtrain.train.tasks import Task

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
    task: Task
    total_steps: int
    """Optimizer steps of the whole run (the lr schedule spans them)."""
    precision: Precision
    batcher: MicroBatcher
    data_stats: dict[str, Any] = field(default_factory=dict)
    """Facts about the data for the summary (e.g. a text corpus's unigram entropy)."""


class Trainer:
    def __init__(self, config: Config, ctx: DistContext, parts: TrainParts, logger: Logger, checkpoints: CheckpointManager):
        self.config = config
        self.ctx = ctx
        self.parts = parts
        self.model = parts.model
        self.module = parts.strategy.unwrap(parts.model)
        self.logger = logger
        self.checkpoints = checkpoints
        self.state = TrainState()
        self.clock = StepClock()
        self.batcher = parts.batcher
        self.precision = parts.precision
        self.total_steps = parts.total_steps
        self.tokens_seen = 0
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
            "precision": self.precision.state_dict(),
            "micro_batch": self.batcher.state_dict(),
            "config_digest": self.config.digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.parts.optimizer.load_state_dict(state["optimizer"])
        self.parts.scheduler.load_state_dict(state["scheduler"])
        self.parts.sampler.load_state_dict(state["sampler"])
        self.state.load_state_dict(state["train_state"])
        self.precision.load_state_dict(state.get("precision", {}))
        if "micro_batch" in state:
            self.batcher.load_state_dict(state["micro_batch"])

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
        self.tokens_seen = 0
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
        window = self.parts.sampler.next_window_size()
        batch = batch.to(self.ctx.device)
        loss_sum, items = self._forward_backward(batch, window)
        with self.clock.phase("optimizer"):
            # fp16: unscale first, so clipping sees the true (already synchronised) gradient.
            self.precision.unscale_(self.parts.optimizer)
            if self.config.train.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip_norm)
            self.precision.step(self.parts.optimizer)
            self.parts.scheduler.step()
            self.parts.optimizer.zero_grad(set_to_none=True)
        self.parts.sampler.advance()
        self.state.step += 1
        self.state.samples_seen += window
        tokens = 0 if self.parts.task.items_are_samples else items
        self.tokens_seen += tokens
        self.clock.end_step(window, tokens=tokens)
        self._step_loss = (loss_sum, items)

    def _forward_backward(self, batch: StepBatch, window: int) -> tuple[torch.Tensor, int]:
        """Accumulate the step's gradient over its micro-batches; returns (this rank's loss sum, items).

        A recoverable step (auto_micro_batch) runs every micro-batch on the bare module, where no forward
        or backward runs a collective (DDP's forward can broadcast buffers), so a rank that runs out of
        memory can stop anywhere without leaving the others waiting in one. Then one all-reduce tells
        every rank whether all fitted: if so, a closing pass through the strategy synchronises the
        gradients (still exactly one all-reduce); if not, every rank drops the gradients, halves the
        micro-batch and redoes the step. The price: that all-reduce no longer overlaps the last backward.
        """
        if not self.batcher.recoverable:
            plan = self.batcher.plan(batch, window)
            with self.clock.phase("compute"):
                return self._accumulate(plan, self.model), plan.global_items
        buffers = BufferSnapshot(self.module)
        while True:
            plan = self.batcher.plan(batch, window)
            with self.clock.phase("compute"):
                try:
                    loss_sum, error = self._accumulate(plan, self.module), None
                except OUT_OF_MEMORY as err:
                    # Keep the message only: the traceback would keep the attempt's activations alive.
                    loss_sum, error = None, str(err)
                failed = self.batcher.failed_ranks(error)
                if not failed:
                    self._sync_gradients(batch)
                    return loss_sum, plan.global_items
            self.parts.optimizer.zero_grad(set_to_none=True)
            buffers.restore()
            self.logger.log(self.batcher.shrink(self.state.step + 1, failed))

    def _accumulate(self, plan: StepPlan, model: nn.Module) -> torch.Tensor:
        """Forward and backward over the plan's micro-batches; returns this rank's loss sum."""
        loss_scale = self.ctx.world_size / plan.global_items
        loss_sum = torch.zeros((), device=self.ctx.device)
        last = len(plan.micro_batches) - 1
        for index, (inputs, targets) in enumerate(plan.micro_batches):
            # Accumulation micro-steps skip gradient sync; only the last backward all-reduces
            # (in a recoverable step none does: _sync_gradients follows).
            sync = index == last and model is self.model
            with nullcontext() if sync else self.parts.strategy.no_sync(self.model):
                with self.precision.autocast():
                    loss = self.parts.task.loss_sum(model(inputs), targets)
                self.batcher.after_forward(self.state.step + 1, is_last=index == last)
                self.precision.scale(loss * loss_scale).backward()
                self.batcher.check_budget()
            loss_sum += loss.detach()
        return loss_sum

    def _sync_gradients(self, batch: StepBatch) -> None:
        """A recoverable step's one gradient all-reduce, run by the strategy: a forward of zero samples
        through the wrapped model and a backward of zero make every parameter's gradient "ready" (adding
        nothing to it), which is what triggers the strategy's synchronisation."""
        outputs = self.model(batch.inputs[:0])
        zero = outputs.sum() + sum(p.sum() for p in self.module.parameters())
        (zero * 0.0).backward()

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.parts.sampler.set_epoch(self.state.epoch)
        every = self.config.monitor.eval_every_epochs
        if every and self.state.epoch % every == 0 and not self.finished:
            self.last_eval = self._evaluate()

    def _maybe_log(self) -> None:
        if self.state.step % self.config.monitor.log_every_steps and not self.finished:
            return
        # All ranks take part (the mean loss is a collective); only rank 0's logger writes it.
        loss_sum, items = self._step_loss
        total = loss_sum.detach().to(torch.float64).reshape(1)
        dist.all_reduce(total)
        self.last_loss = total.item() / items
        record = {
            "type": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": self.last_loss,
            **self.parts.task.train_metrics(self.last_loss),
            "lr": self.parts.scheduler.get_last_lr()[0],
            **self.clock.flush(),
        }
        record.update(self._utilization(record.get("tokens_per_s")))
        self.logger.log(record)

    def _maybe_checkpoint(self) -> None:
        if self.state.step % self.config.checkpoint.every_steps == 0 and not self.finished:
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        self.checkpoints.save(self.state.step, self.state_dict())

    def _evaluate(self) -> dict[str, Any]:
        metrics = evaluate(
            self.module, self.parts.eval_loader, self.parts.task, self.ctx.device, self.precision.autocast
        )
        self.logger.log({"type": "eval", "step": self.state.step, "epoch": self.state.epoch, **metrics})
        return metrics

    def _utilization(self, tokens_per_s: float | None) -> dict[str, float]:
        """MFU of a language model, when the config names the device's peak."""
        flops_per_token = getattr(self.module, "flops_per_token", None)
        peak_tflops = self.config.monitor.peak_tflops
        if tokens_per_s is None or flops_per_token is None or peak_tflops is None:
            return {}
        return {"mfu": model_flops_utilization(tokens_per_s, flops_per_token(), self.ctx.world_size, peak_tflops)}

    def _summary(self, wall_s: float, samples: int) -> dict[str, Any]:
        summary = {
            "world_size": self.ctx.world_size,
            "steps": self.state.step,
            "epochs": round(self.state.samples_seen / self.parts.sampler.num_samples, 3),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(samples / wall_s, 1) if wall_s > 0 else 0.0,
            "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "eval": {k: v for k, v in self.last_eval.items() if k != "count"},
            "micro_batch_size": self.batcher.micro_batch_size,
        }
        if self.tokens_seen and wall_s > 0:
            summary["tokens_per_s"] = round(self.tokens_seen / wall_s, 1)
            summary.update(self._utilization(self.tokens_seen / wall_s))
        if self.parts.data_stats:
            summary["data"] = self.parts.data_stats
        return summary
