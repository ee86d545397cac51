"""One optimizer step's gradient: forward and backward over its micro-batches, synchronised once.

Every micro-batch but the last runs inside ``strategy.no_sync`` (no all-reduce); the last backward
synchronises, so there is exactly one gradient all-reduce per optimizer step. Losses are summed per item
(sample or token) and scaled by ``world_size / items_in_window``, so after the strategy averages over
workers the gradient is the mean over the whole window, exactly as one process would compute it on the
full batch.

With ``train.auto_micro_batch`` a step survives running out of memory: see ``GradientStep.run``.

    gradient = GradientStep(parts, clock, world_size, device)
    loss_sum, items = gradient.run(batch, window, step, on_shrink=logger.log)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from ringtrain.data.batch import call_model, logits_of
from ringtrain.data.loader import StepBatch
from ringtrain.monitor.metrics import StepClock
from ringtrain.parallel import Strategy
from ringtrain.train.batch_size import OUT_OF_MEMORY, BufferSnapshot, MicroBatcher, StepPlan
from ringtrain.train.parts import TrainParts
from ringtrain.train.precision import Precision
from ringtrain.train.tasks import Task

__all__ = ["GradientStep"]


class GradientStep:
    """Computes a step's synchronised gradient; books forward/backward and exposed communication."""

    def __init__(self, parts: TrainParts, clock: StepClock, world_size: int, device: torch.device):
        self.parts = parts
        self.model = parts.model
        """The model as wrapped by the strategy (its backward synchronises)."""
        self.module = parts.module
        self.clock = clock
        self.world_size = world_size
        """The ranks the strategy averages the gradient over (``DistContext.gradient_ranks``): the loss's scale."""
        self.device = device
        self.cp_timer = getattr(parts.module, "cp_comm_timer", None)
        """Context parallelism's ring (``parallel/context.py``): its waits are the step's ``cp_comm`` phase."""

    # The parts are read when used, so a part swapped after building (a test's task) takes effect.
    @property
    def batcher(self) -> MicroBatcher:
        return self.parts.batcher

    @property
    def task(self) -> Task:
        return self.parts.task

    @property
    def strategy(self) -> Strategy:
        return self.parts.strategy

    @property
    def precision(self) -> Precision:
        return self.parts.precision

    def run(self, batch: StepBatch, window: int, step: int, on_shrink: Callable[[dict], None],
            before_sync: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, int]:
        """Accumulate step ``step``'s gradient; returns (this rank's loss sum, items in the window).

        ``before_sync(loss_sum)`` is called once with the whole step's loss sum just before the backward
        that synchronises the gradients, so a collective it starts overlaps that backward (the trainer's
        step agreement). A recoverable step does not call it: nothing may start a collective before its
        end (below).

        A recoverable step (auto_micro_batch) runs every micro-batch on the bare module, where no forward
        or backward runs a collective (DDP's forward can broadcast buffers), so a rank that runs out of
        memory can stop anywhere without leaving the others waiting in one. Then one all-reduce tells
        every rank whether all fitted: if so, a closing pass through the strategy synchronises the
        gradients (still exactly one all-reduce); if not, every rank drops the gradients, halves the
        micro-batch and redoes the step (``on_shrink`` gets the record). The price: that all-reduce no
        longer overlaps the last backward.
        """
        if self.strategy.pipelined:
            return self._pipeline(self._plan(batch, window))
        if not self.batcher.recoverable:
            plan = self._plan(batch, window)
            self.strategy.collective_wait_s()  # what came before this step's passes (evaluation, the last clip) is not its
            with self.clock.phase("forward_backward"):
                loss_sum = self._accumulate(plan, self.model, step, before_sync)
            waited = self.strategy.collective_wait_s()
            if self.strategy.splits_model:  # tensor parallelism: the split layers' all-reduces inside the passes
                self.clock.move("forward_backward", "tp_comm", waited)
            if self.cp_timer is not None:  # context parallelism: the ring's key/value exchanges waited for
                self.clock.move("forward_backward", "cp_comm", self.cp_timer.take_s())
            self._book_exposed_communication()
            return loss_sum, plan.global_items
        buffers = BufferSnapshot(self.module)
        while True:
            plan = self._plan(batch, window)
            with self.clock.phase("forward_backward"):
                try:
                    loss_sum, error = self._accumulate(plan, self.module, step), None
                except OUT_OF_MEMORY as err:
                    # Keep the message only: the traceback would keep the attempt's activations alive.
                    loss_sum, error = None, str(err)
            with self.clock.phase("comm_exposed"):
                failed = self.batcher.failed_ranks(error)
            if not failed:
                with self.clock.phase("forward_backward"):
                    self._sync_gradients(batch)
                self._book_exposed_communication()
                return loss_sum, plan.global_items
            for param in self.module.parameters():
                param.grad = None
            buffers.restore()
            on_shrink(self.batcher.shrink(step, failed))

    def _plan(self, batch: StepBatch, window: int) -> StepPlan:
        # Cutting micro-batches is data preparation (for text it includes the step's token-count all-reduce).
        with self.clock.phase("data"):
            return self.batcher.plan(batch, window)

    def _accumulate(self, plan: StepPlan, model: nn.Module, step: int,
                    before_sync: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Forward and backward over the plan's micro-batches; returns this rank's loss sum."""
        loss_scale = self.world_size / plan.global_items
        loss_sum = torch.zeros((), device=self.device)
        last = len(plan.micro_batches) - 1
        for index, (inputs, targets) in enumerate(plan.micro_batches):
            # Accumulation micro-steps skip gradient sync; only the last backward all-reduces
            # (in a recoverable step none does: _sync_gradients follows).
            sync = index == last and model is self.model
            # loss_context: torch's loss_parallel around forward, loss and backward when the logits are split.
            with nullcontext() if sync else self.strategy.no_sync(self.model), self.strategy.loss_context():
                with self.precision.autocast():
                    outputs = call_model(model, inputs)
                    # A micro-batch of 0 rows (uneven shares, token budgets) still runs the forward, as every
                    # rank must; the loss, which may not accept it, is not called.
                    loss = self.task.loss_sum(outputs, targets) if len(targets) else None
                self.batcher.after_forward(step, is_last=index == last)
                if sync and before_sync is not None:
                    before_sync(loss_sum + _plain(loss.detach()) if loss is not None else loss_sum)
                if loss is not None:
                    self.precision.scale(loss * loss_scale).backward()
                    loss_sum += _plain(loss.detach())
                elif sync or self.strategy.reduces_every_micro_batch:
                    # The strategy's sync still needs this backward (zero2/zero3/fsdp: on every micro-batch);
                    # sharded parameters are only reached through the outputs.
                    sharded = self.strategy.reduces_every_micro_batch
                    _backward_zero(outputs, None if sharded else self.module)
                self.batcher.check_budget()
        return loss_sum

    def _pipeline(self, plan: StepPlan) -> tuple[torch.Tensor, int]:
        """A pipelined step (``parallel/pipeline.py``): the plan's micro-batches are the schedule's. The loss
        of each, on the last stage, is the task's sum over its real rows (padding rows are not read) times the
        step's scale; the schedule runs every forward and backward. The time a rank waited on its neighbours
        is booked as ``pipeline_wait`` (the bubble and the activation transfers), its split layers' collectives
        (tensor parallelism inside the stages) as ``tp_comm``, the ring's waits (context parallelism inside them)
        as ``cp_comm``; the tied weight's and the replicas' gradient sums as exposed communication. Returns the
        loss sum on every rank of the pipeline."""
        loss_scale = self.world_size / plan.global_items
        sums: list[torch.Tensor] = []

        def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if len(targets) == 0:  # a rank with fewer samples than micro-batches: its extra ones are padding
                sums.append(torch.zeros((), device=self.device))
                return outputs.sum() * 0.0
            loss = self.task.loss_sum(outputs[: len(targets)], targets)
            sums.append(loss.detach().float())
            return self.precision.scale(loss * loss_scale)

        self.strategy.collective_wait_s()  # what came before this step's schedule (evaluation, the last clip) is not its
        start = time.perf_counter()
        with self.clock.phase("forward_backward"):
            compute_s = self.strategy.pipeline_step(plan.micro_batches, loss_fn, self.precision.autocast)
        self.clock.move("forward_backward", "pipeline_wait", max(0.0, time.perf_counter() - start - compute_s))
        tp_comm_s = self.strategy.collective_wait_s()  # tensor parallelism inside the stages (0 without)
        if tp_comm_s:
            self.clock.move("forward_backward", "tp_comm", tp_comm_s)
        if self.cp_timer is not None:  # context parallelism inside the stages: the ring's waits
            self.clock.move("forward_backward", "cp_comm", self.cp_timer.take_s())
        with self.clock.phase("comm_exposed"):
            self.strategy.synchronize_gradients()
            # The last stage's losses, one a micro-batch (the calls before them, on a new schedule's first step,
            # were the schedule's shape inference).
            real = sums[len(sums) - len(plan.micro_batches):]
            loss_sum = torch.stack(real).sum() if real else torch.zeros((), device=self.device)
            loss_sum = self.strategy.share_loss(loss_sum)
        return loss_sum, plan.global_items

    def _sync_gradients(self, batch: StepBatch) -> None:
        """A recoverable step's one gradient all-reduce, run by the strategy: a forward of zero samples
        through the wrapped model and a backward of zero make every parameter's gradient "ready" (adding
        nothing to it), which is what triggers the strategy's synchronisation.

        That pass is no batch: the module's buffers (BatchNorm's ``num_batches_tracked``, which a forward in
        training mode counts up) are put back as the module received them. Received, not as they were before
        the call: the strategy's forward may first broadcast rank 0's buffers, and that must stay."""
        received: list[BufferSnapshot] = []
        hook = self.module.register_forward_pre_hook(lambda module, args: received.append(BufferSnapshot(module)))
        try:
            outputs = call_model(self.model, batch.empty()[0])
        finally:
            hook.remove()
        _backward_zero(outputs, self.module)
        # After the backward: a buffer the forward used may be saved for it, and must not change before.
        for snapshot in received:
            snapshot.restore()

    def _book_exposed_communication(self) -> None:
        # The synchronising backward included the wait for the gradient all-reduce: book it as communication.
        self.clock.move("forward_backward", "comm_exposed", self.strategy.comm_timer.backward_done())


def _backward_zero(outputs, module: nn.Module | None) -> None:
    """A backward that adds nothing but makes every parameter's gradient "ready" (what DDP's and the manual
    strategy's synchronisation waits for), through the outputs' graph and each parameter of ``module``."""
    params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
    zero = logits_of(outputs).sum() + sum(p.sum() for p in params)
    (zero * 0.0).backward()


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under ``loss_parallel`` the cross-entropy is a replicated DTensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
