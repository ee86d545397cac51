"""The trainer's seams to its process group: what is bound to a group, leaving it, moving to the next one, and
the state a member sends another (healing: ringtrain/heal/). A mixin of ``Trainer`` (train/loop.py): these are the
trainer's own methods, kept in a file of their own so that the loop reads top to bottom."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from ringtrain.data.ledger import build_ledger
from ringtrain.group.init import DistContext
from ringtrain.host.pinning import host_placement
from ringtrain.group.watch import CollectiveWatch, flight_dumper
from ringtrain.monitor.loggers import build_logger
from ringtrain.parallel import build_strategy
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.train.commit import StepCommit
from ringtrain.train.guards import StepGuard
from ringtrain.train.step import GradientStep

if TYPE_CHECKING:
    from ringtrain.train.loop import Trainer

__all__ = ["GroupSeams"]


class GroupSeams:
    def _bind_group(self) -> None:
        """What works through the process group and is made here, not by the builder (the group's rank and size)."""
        ctx, parts, config = self.ctx, self.parts, self.config
        self.model = parts.model
        self.comm_timer = parts.strategy.comm_timer
        self.batcher = parts.batcher
        self.gradient = GradientStep(parts, self.clock, ctx.gradient_ranks, ctx.device)
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
        old_strategy = parts.strategy
        parts.strategy = build_strategy(config.comm, ctx.device, config.diloco, heal=config.dist.heal)
        parts.model = parts.strategy.wrap(self.module)  # DDP broadcasts rank 0's state: the same everywhere already
        # DiLoCo: the outer state goes on (the old strategy's, or the one received in the transfer).
        parts.strategy.outer_loop.take_over(old_strategy.outer_loop, parts.optimizer, self._received_strategy_state)
        self._received_strategy_state = None
        parts.train_loader, parts.eval_loader = parts.loaders(ctx.dp_rank, ctx.dp_size)
        batcher = MicroBatcher(config.train, parts.task, ctx.dp_rank, ctx.dp_size, ctx.device, ctx.dp_group)
        batcher.load_state_dict(parts.batcher.state_dict())
        parts.batcher = batcher
        parts.job_store.is_writer = ctx.rank == 0
        if ctx.rank == 0 and not was_writer:  # rank 0 was lost: this worker takes over the run directory's files
            logger = build_logger(config, 0, config.run_dir)
            self.logger = self.healing.wrap_logger(logger)
            self.checkpoints = self._checkpoint_front()
            parts.ledger = build_ledger(config.data.ledger, config.run_dir, parts.sampler.num_samples, 0)
            if self._started is not None:  # before the start (a heal while the group starts) ``start`` opens them
                logger.start(self.total_steps, self.state.step, parts.sampler.steps_per_epoch)
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
        self.parts.strategy.close()

    def carry_over(self, old: Trainer) -> None:
        """Go on where ``old`` (built for a group that failed) left off: its start, its signals, its restarts."""
        self.previous, self._started = old.previous, old._started
        self._notices_at_resume = None if old._notices_at_resume is None else 0  # the start counted once
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
                "strategy": {name: part.state_dict() for name, part in self.parts.strategy.outer_loop.transfer_parts().items()},
                "progress": {"eval_due": self.eval_due, "final_eval_done": self.final_eval_done,
                             "last_eval": dict(self.last_eval)}}

    _received_strategy_state: dict[str, Any] | None = None
    """The strategy's part of a transfer this member received, for the strategy of its next group (``regroup``)."""

    def load_transfer_state(self, state: dict[str, Any]) -> None:
        for name, part in self.checkpoint_parts(local=True).items():
            if name in state:
                part.load_state_dict(state[name])
        self._received_strategy_state = state.get("strategy") or None
        self.eval_due = bool(state["progress"]["eval_due"])
        self.final_eval_done = bool(state["progress"]["final_eval_done"])
        self.last_eval = dict(state["progress"]["last_eval"])
