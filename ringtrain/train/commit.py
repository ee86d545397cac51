"""Committing an optimizer step once its gradient is in place: the part of a step the trainer (``ringtrain
train``, ``fit``) and the middle layer (``ringtrain.Session``: a user's own loop) share, so both commit a step
the same way, bit for bit.

1. every rank agrees, in one small all-reduce, whether any loss or gradient was not finite (then all skip the
   update) or a stop was asked (``StepGuard``);
2. the sample ledger records the step's ids (its gather is a replicated step's last collective: from here to
   the commit everything is local, so a rank that applied the update has committed the step, which healing
   relies on);
3. the update is applied (clipped to the global norm) or skipped, the lr schedule steps, the gradients go;
4. the sampler's cursor moves past the step's window and the counters follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ringtrain.data.ledger import NullLedger
from ringtrain.data.sampler import ResumableSampler
from ringtrain.group.jobstore import NullJobStore
from ringtrain.group.watch import CollectiveWatch
from ringtrain.monitor.metrics import StepClock
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.train.guards import PendingVerdict, StepGuard, Verdict
from ringtrain.train.precision import Precision
from ringtrain.train.state import TrainState

__all__ = ["StepCommit"]


class StepCommit:
    """Steps 1-4 of the module's docstring for one group's parts (rebuilt with them when the group changes)."""

    def __init__(self, strategy: ReplicatedStrategy, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 precision: Precision, guard: StepGuard, watch: CollectiveWatch, clock: StepClock,
                 ledger: NullLedger, sampler: ResumableSampler, state: TrainState, job_store: NullJobStore,
                 clip_norm: float | None, fence: Callable[[], None] = lambda: None):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.precision, self.guard, self.watch, self.clock = precision, guard, watch, clock
        self.ledger, self.sampler, self.state, self.job_store = ledger, sampler, state, job_store
        self.clip_norm = clip_norm
        self.fence = fence

    def verdict(self, step: int, loss_sum: torch.Tensor, pending: PendingVerdict | None = None) -> Verdict:
        """Step 1, after the backward: the checks on this rank's loss and gradient, then the agreement (``pending``:
        started beside the synchronising backward; only the gradient's flag remains)."""
        strategy, precision = self.strategy, self.precision
        # fp16's scaler skips overflowing steps itself; on shards, the flag must travel to reach every scaler.
        check_gradients = not precision.skips_overflow or not strategy.gradients_replicated
        with self.clock.phase("optimizer"):
            # fp16: unscale first, so the checks and clipping see the true (synchronised) gradient.
            precision.unscale_(self.optimizer)
            parameters = strategy.gradient_parameters(self.model, self.optimizer)
            if pending is not None:  # the gradient check is local: the synchronised gradient is the same on every rank
                gradient_finite = not check_gradients or self.guard.gradients_finite(parameters)
            else:
                flags = self.guard.check(loss_sum, parameters, gradients=check_gradients)
        # Only the wait for the agreement is communication (the checks above are the optimizer's time).
        with self.clock.phase("comm_exposed"), self.watch.op("all_reduce (step agreement)", step):
            verdict = self.guard.finish(pending, gradient_finite) if pending is not None else self.guard.agree(flags)
        if precision.skips_overflow and not strategy.gradients_replicated:
            verdict = precision.agree_overflow(self.optimizer, verdict)  # every rank's scaler alike
        return verdict

    def apply(self, step: int, verdict: Verdict, indices: list[int], scheduler: Any = None,
              after_update: Callable[[], None] | None = None, last: bool = False) -> None:
        """Steps 2 and 3: record the step, then apply or skip its update (``scheduler``: stepped either way, as a
        fresh run's lr at step s follows s; ``after_update``: called with the gradients still held); then, under
        DiLoCo, the outer step when one is due (``last``: the run's last step, which always ends with one)."""
        with self.clock.phase("monitor"), self.watch.op("gather (sample ledger)", step):
            self.fence()
            self.ledger.record(step, self.state.epoch, indices, skipped=verdict.skip)
        # Sharded strategies communicate here too (the clip's norm, zero's parameter all-gather after the step).
        with self.clock.phase("optimizer"), self.watch.op("optimizer step (sharded norm and all-gather)", step):
            if verdict.skip:
                self.precision.skip(self.optimizer)
            else:
                if self.clip_norm is not None:  # the global norm (sharded strategies sum it over the shards)
                    self.strategy.clip_grad_norm_(self.model, self.optimizer, self.clip_norm)
                self.precision.step(self.optimizer)
            if scheduler is not None:
                scheduler.step()
            if after_update is not None:
                after_update()
            self.optimizer.zero_grad(set_to_none=True)
        self.clock.move("optimizer", "comm_exposed", self.strategy.take_step_comm_s())  # zero1/2's all-gather
        # DiLoCo: inner steps never communicate; every H steps (by step number, the same on every rank, skipped
        # updates included) the pseudo-gradients are averaged and the outer optimizer steps.
        if self.strategy.outer_loop.sync_due(step, last):
            with self.clock.phase("outer_sync"), self.watch.op("all_reduce (DiLoCo pseudo-gradients)", step):
                self.strategy.outer_loop.outer_step(step, last)

    def advance(self, step: int, window: int, tokens: int = 0) -> None:
        """Step 4: the step is done: the data cursor and every counter move past it."""
        self.sampler.advance()
        self.state.step = step
        self.state.samples_seen += window
        self.job_store.record_progress(step)
        self.clock.end_step(window, tokens=tokens)
