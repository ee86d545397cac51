"""``ringtrain.Session``: keep your own training loop, with every ringtrain guarantee, in a few changed lines.

The middle layer between ``fit`` (ringtrain runs the loop) and the building blocks (you run everything), in
the style of Lightning Fabric. One object starts the process group and the run directory, wraps the model
and optimizer with the configured strategy, deals the data exactly once and resumably, scales and
synchronises the backward, and commits each step::

    import ringtrain

    session = ringtrain.Session({"train": {"global_batch_size": 64, "local_batch_size": 32}})
    model, optimizer, scheduler, train_loader = session.setup(model, optimizer, scheduler, data=train_set)
    for epoch in session.epochs(10):                  # resumes mid-epoch after a stop
        for inputs, targets in train_loader:           # this rank's micro-batches of each step
            optimizer.zero_grad()                      # at a step's first micro-batch only
            loss = F.cross_entropy(model(inputs), targets)
            session.backward(loss)                     # the full batch's gradient; synchronised on the last
            optimizer.step()                           # at a step's last micro-batch: the step is committed
            scheduler.step()                           # the session steps it once a step, as it commits
        correct = sum((model(x).argmax(1) == y).sum() for x, y in session.eval_loader(val_set, 256))
        session.print(f"epoch {epoch}: accuracy {session.sum(correct) / len(val_set):.3f}")

What a committed step does (``optimizer.step()`` at a step's last micro-batch, ``commit_step``): every rank
agrees in one small all-reduce whether any loss or gradient was not finite (then all skip the update) or a
stop was asked (SIGTERM, Ctrl-C: then all save the step and exit, ``--resume`` goes on); the sample ledger
records the step's ids; the update is applied (clipped by ``[train] grad_clip_norm``); the sampler's cursor
moves past the step's window; the step is checkpointed every ``[checkpoint] every_steps`` (verified, sharded
when the strategy or the config says so, with your scheduler and anything ``register``ed). A run directory
holds what ``ringtrain train`` writes: config.toml, metrics.jsonl, the ledger, checkpoints/, summary.json.

``reduction``: ``session.backward(loss)`` takes a loss that averages over the micro-batch's samples (the
default of torch's losses) and weights it by their share of the step's samples; ``reduction="sum"`` takes a
sum and divides by the step's sample count, which is exactly what ``ringtrain train`` does (bit for bit).
Launch with ``torchrun``, ``ringtrain run``, or ``python`` (one worker).

Pipeline parallelism (``[parallel] pp`` > 1): ``setup(model, optimizer, data=..., pp_split=split)`` cuts the model
into stages (``split(model, stages)``, as ``fit(pp_split=...)``; an ``nn.Sequential`` by its children without
one); the loader yields each step's whole share once, and ``loss = session.forward_backward((inputs, targets),
loss_fn)`` runs it through the schedule in place of ``model(inputs)`` and ``backward`` (the loss comes back on
every rank of the pipeline); ``optimizer.step()`` commits the step as above.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ringtrain.checkpoint.front import CheckpointFront
from ringtrain.config import validate_for_world_size
from ringtrain.config.checks import outer_step_warning
from ringtrain.config.parallel import resolve_layout
from ringtrain.data.batch import split as split_rows
from ringtrain.data.ledger import build_ledger
from ringtrain.data.loader import StepBatch, build_eval_loader, build_train_loader
from ringtrain.data.sampler import ResumableSampler
from ringtrain.group.env import DistEnv
from ringtrain.group.init import init_distributed
from ringtrain.group.jobstore import connect_job_store
from ringtrain.group.lifetime import exit_with_parent
from ringtrain.group.watch import HEARTBEAT_INTERVAL_S, CollectiveWatch, Heartbeat, flight_dumper
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.monitor.loggers import NullLogger, build_logger
from ringtrain.monitor.metrics import StepClock
from ringtrain.parallel import build_parallel
from ringtrain.strategies import strategy_spec
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.testing import faults
from ringtrain.train.build import arm_fault_plan, broadcast_from_rank0
from ringtrain.train.commit import StepCommit
from ringtrain.train.guards import StepGuard, StopSignal, Verdict, check_replicas
from ringtrain.train.optim import build_lr_scheduler, build_optimizer
from ringtrain.train.precision import Precision
from ringtrain.group.jobstore import PreviousAttempt
from ringtrain.train.resume import check_same_choice, resume_record
from ringtrain.train.run import finished_summary
from ringtrain.train.run_lock import RunDirLock
from ringtrain.train.state import TrainState
from ringtrain.train.user_parts import describe_callable
from ringtrain.train.stateful import CommState, ModelState, OptimizerState, RunInfo, ScheduleState, ShardedTensors

from ringtrain.train.session_parts import (RESERVED_PARTS, EvalLoader, PlainValue, Samples, SessionLoader,
                                           SessionOptimizer, SessionScheduler, check_plain_value, current_lr,
                                           exit_with, follow_parameters, planned_steps, resolve_config, resume_plan, usage)

__all__ = ["Session"]


class Session:
    """See the module's docstring. ``config``: a dict of sections, a TOML path or a ``Config`` (the sections that
    concern a loop: ``train``, ``comm``, ``dist``, ``checkpoint``, ``data`` (``ledger``, ``num_workers``),
    ``monitor``); ``run_dir`` overrides its run directory; ``resume``: True (the newest valid checkpoint
    of the run directory; it must exist), a checkpoint path (a new run from it), or False/None (a fresh run,
    unless ``ringtrain run --resume`` or a restart says otherwise)."""

    def __init__(self, config: Any = None, *, run_dir: str | Path | None = None, resume: bool | str | Path | None = None):
        env = DistEnv.from_environ()
        exit_with_parent()  # under a launcher: a worker never outlives its agent
        try:
            self.config = resolve_config(config, env, run_dir)
            validate_for_world_size(self.config, env.world_size)
            layout = resolve_layout(self.config.parallel, self.config.comm.strategy, env.world_size)
            self._layout = layout
            self.plan = resume_plan(resume, env, self.config)
        except RingtrainError as err:
            exit_with(err, env)
        self._group = init_distributed(env, self.config.dist)
        self.ctx = self._group.__enter__()
        from ringtrain.worker import uncaught_reporter

        # An exception that leaves the user's loop is told as fit tells it (one line, the traceback kept); set
        # after the group starts, whose own hook would prefix every line of a raw traceback with "[rankR]: ".
        self._excepthook, sys.excepthook = sys.excepthook, uncaught_reporter(env, lambda: self.config.run_dir)
        if self.ctx.env.fault_plan and not faults.is_armed():  # a test harness's fault plan: nothing in a user's run
            arm_fault_plan(self.ctx, None)
        self._closers: list[Any] = []
        self.job_store = connect_job_store(self.ctx.env, is_writer=self.rank == 0)
        # A failed collective (and SIGUSR1 to the launcher) dumps the flight recorder, as under fit.
        dump = (flight_dumper(self.config.run_dir, self.rank, self.world_size) if self.config.dist.flight_recorder
                else None)
        self._closers.append(Heartbeat(self.job_store, self.rank, HEARTBEAT_INTERVAL_S, on_dump_request=dump).__enter__())
        if self.rank == 0:
            self._closers.append(RunDirLock(self.config.run_dir).__enter__())
        self.logger = NullLogger()  # until training starts: its config then records what the session trains
        self.state = TrainState()
        self.clock = StepClock()
        self.precision = Precision(self.config.train.precision, self.device)
        # A stop ends this worker (SystemExit below): a late SIGUSR1 (SLURM's copy to every process, or the agent's
        # forwarded one) must not kill it before its "stopped" line and exit code, as in the Trainer (guards.py).
        self.stop_signal = StopSignal(absorb_after_stop=True)
        self.guard = StepGuard(self.rank, self.world_size, self.device, self.config.train.max_consecutive_nonfinite_steps,
                               self.stop_signal)
        self.watch = CollectiveWatch(self.job_store, self.rank, self.world_size, self.config.dist.timeout_s,
                                     on_failure=dump)
        ckpt = self.config.checkpoint
        self.checkpoints = CheckpointFront(Path(self.config.run_dir) / ckpt.dir, self.rank, self.world_size,
                                           ckpt.keep_last, sharded=ckpt.sharded, background=ckpt.async_)
        self.registered: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        """The plain values ``register``ed (name -> value): set them in your loop; a resume gives them back."""
        self._save_due = False
        self._resumed: Path | None = None
        """The checkpoint this run resumed from (None: a fresh run)."""
        self._summary: dict[str, Any] | None = None
        """The run's summary once ``finish`` wrote it, or a resumed finished run's summary.json (nothing is
        trained or written): ``finish`` returns it again."""
        self._is_ready = False
        self.strategy = self.model = self.module = self.optimizer = self.scheduler = self.sampler = None
        self._micro: tuple[int, bool, int] = (0, True, 1)
        """The micro-batch in the user's hands: (its rows, whether it is the step's last, the step's samples)."""
        self._step_loss = torch.zeros(())
        self._batch: StepBatch | None = None
        self._plan: Any = None
        """Under pp: the step's micro-batch plan until ``forward_backward`` runs it (None: it ran)."""
        self._window = 0
        self._saved_step = -1
        self._pending = None
        self._started = time.perf_counter()
        """When training started (the first batch asked for): summary.json's wall_s counts from here, as fit's."""
        self._yielded = self._started
        self._outside_since: float | None = None
        self.total_steps = 0
        self.start_step = 0
        """The step this run started from (a resume's checkpoint; 0 for a fresh run)."""
        atexit.register(self.close)  # a group left to the interpreter's end can abort it

    # --- where this worker is ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank, 0 to ``world_size - 1`` (rank 0 writes the run directory)."""
        return self.ctx.rank

    @property
    def is_main(self) -> bool:
        """Whether this worker is rank 0: the one to write your own files (a best model, a plot)."""
        return self.ctx.rank == 0

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    # --- setting up ---------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
              data: Dataset | None = None, collate_fn: Any = None, *, tp_plan: Any = None,
              pp_split: Any = None) -> tuple:
        """Wrap ``model`` with the configured strategy (``[comm] strategy``: ddp, manual, zero1-3, fsdp) after
        making every rank's weights rank 0's; take ``optimizer`` over it (None: ``[train] optimizer``) and
        ``scheduler`` over that (None with no optimizer given: ``[train]``'s warm-up and cosine; with your
        optimizer, none: pass your own), each stepped once a step; ``data``: as ``loader(data)``. ``tp_plan``:
        with ``[parallel] tp`` > 1, how the model splits over the tensor-parallel ranks (as ``fit(tp_plan=...)``;
        a Hugging Face model's own plan when left out); those ranks read the same samples. ``pp_split``: with
        ``[parallel] pp`` > 1, how the model is cut into pipeline stages (as ``fit(pp_split=...)``:
        ``pp_split(model, stages)`` returns the stage modules in order; an ``nn.Sequential`` is cut by its children
        when left out); the model returned is this rank's stages, which ``forward_backward`` runs. Returns the
        model, optimizer, scheduler and loader (those given or made), in that order."""
        if self.model is not None:
            usage("Session.setup was called twice; set up the model and optimizer in one call")
        module = model.to(self.device)
        broadcast_from_rank0(module)  # every replica starts from rank 0's weights
        # For the record (config.toml): what this run trains.
        self.config = self.config.model_copy(update={
            "model": self.config.model.model_copy(update={"factory": describe_callable(model)})})
        if tp_plan is not None and self._layout.tp == 1:
            usage("session.setup(tp_plan=...) splits the model over tensor-parallel ranks, but parallel.tp is 1 "
                  "here; set {'parallel': {'tp': 2}} (or more), or leave tp_plan out")
        if pp_split is not None and self._layout.pp == 1:
            usage("session.setup(pp_split=...) cuts the model into pipeline stages, but parallel.pp is 1 here; set "
                  "{'parallel': {'pp': 2}} (or more), or leave pp_split out")
        if pp_split is not None and not callable(pp_split):
            usage(f"session.setup(pp_split=...) takes a callable split(model, stages) returning the stage modules "
                  f"in order, not {type(pp_split).__name__}")
        # The one way in to every layout, as fit's: the layout's mesh, the tp split, checkpointing, the strategy.
        names = {id(param): name for name, param in module.named_parameters()}
        parallel = build_parallel(self.config, self.ctx, module, tp_plan=tp_plan, pp_split=pp_split)
        self.ctx, self.strategy = parallel.ctx, parallel.strategy
        self.module, self.model = module, parallel.model
        if optimizer is not None:  # made over the whole module: moved onto the split (tp) or sharded parameters
            follow_parameters(optimizer, names, dict(module.named_parameters()))
        if self.sampler is not None:  # loader() came first: dealt now that this rank's data-parallel place is known
            self._deal()
        made = self._made_optimizer = optimizer is None
        optimizer = build_optimizer(self.config.train, module.parameters()) if made else optimizer
        self.optimizer = self.strategy.shard_optimizer(optimizer)
        loader = self.loader(data, collate_fn) if data is not None else None
        self._made_scheduler = scheduler is None and made and self.sampler is not None
        if self._made_scheduler:  # [train]'s schedule: positioned at the step on resume, never carried
            scheduler = build_lr_scheduler(self.config.train, self.optimizer, self.total_steps)
        self.scheduler = scheduler
        outputs = [self.model, SessionOptimizer(self, self.optimizer)]
        if scheduler is not None:
            outputs.append(SessionScheduler(self, scheduler))
        return tuple(outputs if loader is None else [*outputs, loader])

    def loader(self, data: Dataset, collate_fn: Any = None) -> SessionLoader:
        """Deal ``data`` (a map-style Dataset of (input, target) items) exactly once per epoch: each step takes
        the next ``[train] global_batch_size`` samples of the epoch's order, this rank's share cut into
        micro-batches of at most ``local_batch_size``; iterating yields this rank's micro-batches of each step
        left in the epoch (``len``: steps per epoch). A resume goes on from the cursor, mid-epoch."""
        if self.sampler is not None:
            usage("Session.loader was called twice; a session deals one training set")
        self.config = self.config.model_copy(update={
            "data": self.config.data.model_copy(update={"factory": describe_callable(data)})})
        self.sampler = ResumableSampler(len(data), self.config.train.global_batch_size, seed=self.config.train.seed)
        self._data = (data, collate_fn)
        if self.strategy is not None:  # else setup deals it, once this rank's data-parallel place is known
            self._deal()
        self.total_steps = planned_steps(self.config, self.sampler.steps_per_epoch)
        return SessionLoader(self)

    def _deal(self) -> None:
        """The step loader, ledger and micro-batch plan over the data-parallel ranks (as the Trainer's,
        train/build.py): the ranks of a tensor-parallel group read the same samples, and only its first records
        them."""
        (data, collate_fn), ctx = self._data, self.ctx
        self._loader = build_train_loader(data, self.sampler, ctx.dp_rank, ctx.dp_size,
                                          num_workers=self.config.data.num_workers, collate_fn=collate_fn)
        self.ledger = build_ledger(self.config.data.ledger, self.config.run_dir, len(data), ctx.rank, ctx.dp_group,
                                   ctx.data_leader)
        self.batcher = MicroBatcher(self.config.train, Samples(), ctx.dp_rank, ctx.dp_size, self.device, ctx.dp_group,
                                    count=self.strategy.microbatches, count_multiple=self.strategy.microbatch_multiple)

    def _ready(self) -> None:
        """Before the first step: continue from a checkpoint when the session resumes, open the records."""
        if self._is_ready:
            return
        if self.model is None or self.sampler is None:
            usage("a Session needs its model (session.setup) and its data (session.loader) before "
                              "training: call both first")
        self._is_ready = True
        self._resume()
        self.start_step = self.state.step
        if self.plan.resume:  # a run resumed at its planned end: "already finished", nothing trained or written
            self._summary = finished_summary(self.config.run_dir, self.state.step >= self.total_steps, self.rank,
                                             self.state.step)
            if self._summary is not None:
                return
        self.logger = build_logger(self.config, self.rank, self.config.run_dir)
        self.logger.start(self.total_steps, self.state.step, self.sampler.steps_per_epoch)
        warning = outer_step_warning(self.config, self.total_steps)
        if warning is not None:  # rank 0's logger: a console line and a record
            self.logger.log({"type": "warning", "message": warning})
        if self._resumed is not None:  # the record that starts an attempt (`ringtrain report` sums every one)
            self.logger.log(resume_record(self._resumed, self.state.step, self.world_size,
                                          PreviousAttempt(starts=1, last_step=None, last_step_time=None)))
        self.ledger.start(self.state.step)
        self._start_samples = self.state.samples_seen
        self._started = time.perf_counter()
        self.clock.flush()

    def register(self, name: str, part: Any) -> Any:
        """Checkpoint ``part`` under ``name``, loaded on resume: an object with state_dict / load_state_dict, or
        a plain value (None, bool, int, float, str, lists and dicts of them), kept as JSON in each checkpoint
        and held in ``session.values[name]``, where your loop updates it and a resume puts the saved value
        back. Register before training starts (``epochs`` or the loader's first batch). Returns ``part``."""
        if self._is_ready:
            usage(f"session.register({name!r}, ...) after training started: a resume loads what is registered "
                  "before it; register before session.epochs() (or the loader's first batch)")
        if name in RESERVED_PARTS:
            usage(f"session.register({name!r}, ...): the session's checkpoint holds its own {name!r}; pick "
                  "another name")
        if hasattr(part, "state_dict") and hasattr(part, "load_state_dict"):
            self.registered[name] = part
        else:
            check_plain_value(name, part)
            self.values[name] = part
            self.registered[name] = PlainValue(self.values, name)
        return part

    def epochs(self, count: int | None = None) -> Iterator[int]:
        """The epochs left to train (all of ``count``, default ``[train] epochs``; after a resume, the rest, the
        first one from where it stopped). When they are done, the last step is saved and summary.json written."""
        count = self.config.train.epochs if count is None else count
        self.config = self.config.model_copy(update={"train": self.config.train.model_copy(update={"epochs": count})})
        if self.sampler is not None:
            self.total_steps = planned_steps(self.config, self.sampler.steps_per_epoch, count)
        self._ready()
        with self.stop_signal:
            while self.state.epoch < count and self.state.step < self.total_steps:
                yield self.state.epoch
                self._book_outside()
                if self._save_due:  # the epoch's last step, saved after your end-of-epoch code (its values)
                    with self.clock.phase("checkpoint"):
                        self.save()
        self.finish()

    def _book_outside(self) -> None:
        """The loop's own code between the epoch's last batch and now (its evaluation, a best model saved): booked
        as evaluation, so the step's phases still add up to the step."""
        if self._outside_since is not None:
            self.clock.phase_totals["eval"] += time.perf_counter() - self._outside_since
            self._outside_since = None

    # --- the step ----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, reduction: str = "mean") -> None:
        """Backward of this micro-batch's loss, scaled so that the step's gradient is the full batch's: a mean
        over the micro-batch's samples is weighted by their share of the step's samples, a sum (``"sum"``) is
        divided by the step's sample count; DDP's average over the ranks is allowed for. Gradients synchronise
        on the step's last micro-batch only."""
        if reduction not in ("mean", "sum"):
            usage(f"Session.backward(reduction={reduction!r}): use 'mean' or 'sum'")
        if self.strategy is not None and self.strategy.pipelined:
            usage("session.backward(loss) under parallel.pp > 1: the pipeline's schedule runs the forward and "
                  "backward; call loss = session.forward_backward((inputs, targets), loss_fn) instead of "
                  "model(inputs) and session.backward(loss)")
        rows, _, items = self._micro
        weight = rows if reduction == "mean" else 1
        if rows == 0:  # an empty share (the step's samples do not divide over the ranks): no loss, every hook
            loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        # The last micro-batch's backward synchronises the gradients: a peer's failure there is one line.
        with self.watch.op(self.strategy.step_operation, self.state.step + 1):
                self.precision.scale(loss * (self.ctx.gradient_ranks / items * weight)).backward()
        # The step's breakdown, as the Trainer's: the user's forward and this backward since the loader yielded
        # the micro-batch; the synchronising backward's wait for the gradient all-reduce is exposed communication.
        self.clock.phase_totals["forward_backward"] += time.perf_counter() - self._yielded
        if self._micro[1]:
            self.clock.move("forward_backward", "comm_exposed", self.strategy.comm_timer.backward_done())
        self._step_loss = self._step_loss + loss.detach().float().cpu() * weight

    def forward_backward(self, batch: tuple[Any, torch.Tensor], loss_fn: Any, reduction: str = "mean") -> torch.Tensor:
        """Under ``[parallel] pp`` > 1, the step's forward and backward through the pipeline's schedule (as
        torch's ``schedule.step`` and torchtitan's pipelined train step): ``batch``, the (inputs, targets) the
        loader yielded for the step (this rank's whole share), is cut into the schedule's ``pp_microbatches``;
        the last stage calls ``loss_fn(outputs, targets)`` on each micro-batch's rows, a mean over them (or a sum:
        ``reduction="sum"``), scaled as ``backward`` scales it so the step's gradient is the full batch's; the
        gradients are then averaged over the pipeline's data-parallel replicas. Returns the loss of this rank's
        share (its mean, or its sum), on every rank of the pipeline (sent from the last stage). Call it once a
        step, between ``optimizer.zero_grad()`` and ``optimizer.step()``."""
        if reduction not in ("mean", "sum"):
            usage(f"Session.forward_backward(reduction={reduction!r}): use 'mean' or 'sum'")
        if self.strategy is None or not self.strategy.pipelined:
            usage("session.forward_backward(batch, loss_fn) runs a pipeline's schedule (parallel.pp > 1), and pp is 1 "
                  "here; compute loss_fn(model(inputs), targets) and call session.backward(loss)")
        if self._plan is None:
            usage("session.forward_backward(batch, loss_fn) outside a step: call it once for each batch the "
                  "session's loader yields")
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            usage(f"session.forward_backward(batch, loss_fn) takes the loader's (inputs, targets), not a "
                  f"{type(batch).__name__}")
        rows, _, items = self._micro
        if len(targets) != rows:
            usage(f"session.forward_backward: the batch has {len(targets)} targets, but this rank's share of the "
                  f"step is {rows} samples; pass the (inputs, targets) the loader yielded, whole")
        count = len(self._plan.micro_batches)
        micro = list(zip(split_rows(inputs, count), torch.tensor_split(targets, count)))
        self._plan, scale, sums = None, self.ctx.gradient_ranks / items, []

        def scaled(outputs: torch.Tensor, micro_targets: torch.Tensor) -> torch.Tensor:
            if len(micro_targets) == 0:  # a share with fewer samples than micro-batches: its padding
                sums.append(torch.zeros((), device=self.device))
                return outputs.sum() * 0.0
            loss = loss_fn(outputs[: len(micro_targets)], micro_targets)  # rows past them pad the micro-batch
            weight = len(micro_targets) if reduction == "mean" else 1
            sums.append(loss.detach().float() * weight)
            return self.precision.scale(loss * (scale * weight))

        start = time.perf_counter()
        with self.watch.op(self.strategy.step_operation, self.state.step + 1):
            compute_s = self.strategy.pipeline_step(micro, scaled, self.precision.autocast)
            # The breakdown, as the Trainer's pipelined step: the loop's code since the loader yielded and the
            # schedule are forward+backward, less the waits on the neighbours (the bubble, the transfers).
            done = time.perf_counter()
            self.clock.phase_totals["forward_backward"] += done - self._yielded
            self.clock.move("forward_backward", "pipeline_wait", max(0.0, done - start - compute_s))
            with self.clock.phase("comm_exposed"):
                self.strategy.synchronize_gradients()
                # The last stage's losses, one a micro-batch (a new schedule's first step also called it for shapes).
                real = sums[len(sums) - count:]
                loss_sum = torch.stack(real).sum() if real else torch.zeros((), device=self.device)
                loss_sum = self.strategy.share_loss(loss_sum)
        self._step_loss = loss_sum.detach().float().cpu()
        return loss_sum / max(1, rows) if reduction == "mean" else loss_sum

    def _commit_step(self) -> Verdict:
        """The step in progress is complete (its last micro-batch's backward ran): commit it as ``ringtrain train``
        does (train/commit.py: agree, record, apply or skip, advance)."""
        step, loss_sum = self.state.step + 1, self._step_loss
        commit = StepCommit(self.strategy, self.model, self.optimizer, self.precision, self.guard, self.watch,
                            self.clock, self.ledger, self.sampler, self.state, self.job_store,
                            self.config.train.grad_clip_norm)
        verdict = commit.verdict(step, loss_sum)
        # The scheduler steps here, once a step, before anything is saved (the loop's own call does nothing).
        # The run's last planned step ends with an outer step under DiLoCo (every rank on one model).
        commit.apply(step, verdict, self._batch.indices.tolist(), scheduler=self.scheduler,
                     last=0 < self.total_steps <= step)
        commit.advance(step, self._window)
        self.strategy.comm_timer.end_step()
        self.guard.count(verdict, self.state, step)
        return verdict

    def _after_step(self, verdict: Verdict, loss_sum: torch.Tensor) -> None:
        """The user's loop committed a step: the epoch's end, the records, the checkpoint, a stop."""
        if self.sampler.epoch_finished:
            self.state.epoch += 1
            self.sampler.set_epoch(self.state.epoch)
        with self.clock.phase("monitor"):
            if self.state.step % self.config.monitor.log_every_steps == 0:
                timing = self.clock.flush()  # the interval ends here; this record's cost is booked in the next
                self.logger.log({"type": "train", "step": self.state.step, "epoch": self.state.epoch,
                                 "loss": loss_sum.item() / max(1, self._window), "lr": current_lr(self.optimizer),
                                 **timing, **self.strategy.comm_timer.flush(),
                                 "comm_fraction": timing.get("time/comm_exposed_s", 0.0) / timing["step_time_s"]})
            self.logger.on_step(self.state.step, self.state.epoch)
            if verdict.skip:
                self.logger.log({"type": "skip", "step": self.state.step, "reason": verdict.describe()})
        if verdict.stop:  # SIGTERM or Ctrl-C on some rank: every rank saves this step and leaves
            self.stop_signal.mark_stopped()
            self.save()
            self._wait_save()
            number = self.stop_signal.signal_number or signal.SIGTERM
            self.print(f"ringtrain: stopped at step {self.state.step} after saving it "
                       f"({signal.Signals(number).name}); continue with Session(resume=True) (or --resume)",
                       file=sys.stderr)
            self.close()
            raise SystemExit(128 + number)
        if self.state.step % self.config.checkpoint.every_steps == 0 and self.state.step < self.total_steps:
            if self.sampler.cursor == 0:  # an epoch's last step: saved as the next epoch starts, so it holds
                self._save_due = True     # what the end of this one registers (a best accuracy)
            else:
                with self.clock.phase("checkpoint"):
                    self.save()

    # --- checkpoints -------------------------------------------------------------------------------------
    def parts(self) -> dict[str, Any]:
        """What a checkpoint of this session holds (loaded in this order on resume)."""
        parts = {"run": RunInfo(self.config, self.optimizer, self.world_size),
                 "model": ModelState(self.strategy, self.model),
                 "optimizer": OptimizerState(self.strategy, self.optimizer, keep_hyperparameters=self._made_optimizer)}
        if self.sampler is not None:
            parts.update(sampler=self.sampler, micro_batch=self.batcher)
        parts.update(train_state=self.state, precision=self.precision)
        if self.scheduler is not None:  # yours is carried; [train]'s follows this run's config (as ringtrain train)
            parts["scheduler"] = ScheduleState(self.scheduler, self.state) if self._made_scheduler else self.scheduler
        parts.update(comm=CommState(self.strategy, self.rank, self.world_size, self._warn),
                     **self.strategy.stateful_parts(), **self.registered)  # DiLoCo's outer state, as ringtrain train's
        return parts

    def _tensors(self) -> ShardedTensors:
        """The model's and optimizer's tensors as a sharded checkpoint holds them (each rank's own too under DiLoCo)."""
        return ShardedTensors(self.strategy, self.model, self.optimizer, self.rank, self.world_size, self._warn)

    def save(self) -> None:
        """Checkpoint the step reached (every rank calls it; verified; sharded as configured). Done for you every
        ``[checkpoint] every_steps``, at the end, and on a stop."""
        self._wait_save()
        self._pending = self.checkpoints.save(self.state.step, self.parts(), self._tensors(),
                                              config_sha256=self.config.digest())
        if not self.config.checkpoint.async_:
            self._wait_save()
        self._saved_step, self._save_due = self.state.step, False

    def _wait_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result(timeout=self.config.dist.timeout_s + 600)

    def _resume(self) -> None:
        found = self.checkpoints.newest(self._warn) if self.plan.resume else None
        if found is None and self.plan.resume and self.plan.source is not None:
            from ringtrain.checkpoint.front import Found
            from ringtrain.checkpoint.manager import checkpoint_step

            found = Found(self.plan.source, checkpoint_step(self.plan.source) or 0, sharded=False)
        check_same_choice(-1 if found is None else found.step)
        if found is None:
            if self.plan.required:
                exit_with(ConfigError(f"resume: no valid checkpoint in {self.checkpoints.directory}; start afresh "
                                       "without resume"), self.ctx.env)
            return
        self.checkpoints.load(found, self.parts(), self._tensors())
        self._resumed = found.path
        self.print(f"ringtrain: resumed from {found.path.name} (step {self.state.step})", file=sys.stderr)

    # --- the model as yours ------------------------------------------------------------------------------
    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """Your own module inside the model ``setup`` returned (DDP's ``module.`` gone from its keys): for saving
        (``session.unwrap(model).state_dict()`` loads into your plain model) or evaluation. Under zero3 and
        fsdp each rank holds a shard of the weights, not the module, and under tp or pp its part of it: use
        ``model_state_dict()`` there."""
        if self.model is None:
            usage("session.unwrap(model) before session.setup(model): set the model up first")
        if model is not None and model is not self.model and model is not self.module:
            usage("session.unwrap(model) takes the model session.setup returned (or the module you gave it)")
        strategy = self.config.comm.strategy
        if self.strategy.pipelined:
            usage("session.unwrap(model) under parallel.pp > 1: each pipeline rank holds its own stages, so no rank's "
                  "module is the whole model; take the whole weights with session.model_state_dict() (every rank "
                  "calls it)")
        if self._layout.tp > 1:
            usage("session.unwrap(model) under parallel.tp > 1: each rank's module holds its tensor-parallel part of "
                  "the weights, so its state_dict does not load into your plain model; take the whole weights with "
                  "session.model_state_dict() (every rank calls it)")
        if not strategy_spec(strategy).module_is_users:
            usage(f"session.unwrap(model) under comm.strategy '{strategy}': each rank holds a shard of the weights, "
                  "so no rank's module is the whole model; take the whole weights with session.model_state_dict() "
                  "(every rank calls it)")
        return self.module

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Under ``[parallel] pp`` > 1, evaluation's forward: ``inputs`` through every stage in order (no
        schedule, no gradient), the outputs returned on every rank of the pipeline (sent from the last stage), so
        the evaluation code after it is the one you run without pp. Every rank of the pipeline calls it with the
        same batch (``session.eval_loader`` deals them so); put the stages in eval mode first (``model.eval()``)."""
        if self.model is None:
            usage("session.forward(inputs) before session.setup(model): set the model up first")
        if not self.strategy.pipelined:
            usage("session.forward(inputs) runs a pipeline's stages for evaluation (parallel.pp > 1), and pp is 1 "
                  "here; call your model: outputs = model(inputs)")
        if not isinstance(inputs, torch.Tensor):
            usage(f"session.forward(inputs) takes the inputs tensor of a batch, not a {type(inputs).__name__}")
        with self.watch.op("pipeline forward (session.forward)", self.state.step):
            return self.strategy.forward_to_all(inputs.to(self.device))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under your module's keys, on every rank (every rank calls it: zero3 and fsdp
        gather their shards), e.g. to save the best model from rank 0."""
        if self.model is None:
            usage("session.model_state_dict() before session.setup(model): set the model up first")
        return self.strategy.model_state_dict(self.model)

    # --- evaluation and what ranks share -----------------------------------------------------------------
    def eval_loader(self, data: Dataset, batch_size: int, collate_fn: Any = None) -> Iterator[tuple[Any, Any]]:
        """This rank's part of ``data``: every sample exactly once across ranks (sum what you count with ``sum``).
        Every rank gets as many batches (the last ones may hold no sample): a wrapped model's forward may be a
        collective (DDP's buffers, zero3 and FSDP gathering parameters)."""
        rank, ranks = self.ctx.dp_rank, self.ctx.dp_size  # after setup under tp: its group reads the same samples
        loader = build_eval_loader(data, rank, ranks, batch_size, collate_fn=collate_fn)
        counts = [math.ceil(len(range(r, len(data), ranks)) / batch_size) for r in range(ranks)]
        # Resolved as the batches are handed out: eval_loader may come before setup() (no strategy yet).
        return EvalLoader(loader, max(counts), lambda: (self.strategy.outer_loop.evaluation_weights() if self.strategy is not None
                                                        else contextlib.nullcontext()))

    def sum(self, value: Any) -> Any:
        """``value`` (a number or a tensor) summed over every rank."""
        tensor = torch.as_tensor(value, dtype=torch.float64).clone()
        if dist.is_initialized() and self.world_size > 1:
            with self.watch.op("all_reduce (session.sum)", self.state.step):
                dist.all_reduce(tensor, group=self.ctx.dp_group)  # tensor-parallel peers counted the same samples
        return tensor.item() if tensor.dim() == 0 and not isinstance(value, torch.Tensor) else tensor

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def _warn(self, message: str) -> None:
        self.print(f"ringtrain: warning: {message}", file=sys.stderr)

    # --- the end -------------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Save the last step and write summary.json (``epochs`` does it when its loop ends); called again, the
        summary without writing anything."""
        if self._summary is not None:  # finished already (or resumed at its end): nothing written again
            return self._summary
        # A loop that left before the planned last step: DiLoCo's workers still hold their own parameters; the
        # run ends on one model, as the planned last step would have (one outer step; nothing for others).
        self.strategy.outer_loop.end_of_run()
        if self._saved_step != self.state.step:
            self.save()
        self._wait_save()
        wall_s = time.perf_counter() - self._started
        digests = check_replicas(self.strategy.full_named_parameters(self.model), self.state.step)
        samples = self.state.samples_seen - self._start_samples
        summary = {"world_size": self.world_size, "steps": self.state.step,
                   "epochs": round(self.state.samples_seen / self.sampler.num_samples, 3), "wall_s": round(wall_s, 3),
                   "samples_per_s": round(samples / wall_s, 1) if wall_s > 0 else 0.0,
                   "skipped_steps": self.state.skipped_steps, "param_sha256": digests,
                   **self.strategy.figures()}  # DiLoCo: outer steps, bytes each worker sent (as ringtrain train)
        self.ledger.close()
        self.logger.finish(summary)
        self._summary = summary
        return summary

    def close(self) -> None:
        """Leave the process group and release the run directory (at exit if not called)."""
        if self._group is None:
            return
        for part in reversed(self._closers):
            part.__exit__(None, None, None)
        self._closers = []
        if self.strategy is not None:  # set up
            self.strategy.close()
        group, self._group = self._group, None
        sys.excepthook = self._excepthook
        self.model = self.optimizer = None  # DDP's reducer holds the group: gone before it is destroyed
        group.__exit__(None, None, None)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
