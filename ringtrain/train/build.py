"""Build the parts of a run, then hand them to the Trainer (torchtitan's build-then-wire shape)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ringtrain.config import Config, validate_for_backend
from ringtrain.config.checks import outer_step_warning
from ringtrain.data import ResumableSampler, build_eval_loader, build_train_loader
from ringtrain.data.ledger import build_ledger
from ringtrain.group.env import forget_fault_plan
from ringtrain.group.init import DistContext
from ringtrain.group.jobstore import NullJobStore
from ringtrain.monitor.loggers import build_logger
from ringtrain.parallel import build_parallel
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.train.healing_hooks import NoHealing
from ringtrain.train.keep_best import BestModel
from ringtrain.train.loop import TrainParts, Trainer
from ringtrain.train.optim import build_lr_scheduler, build_optimizer, record_optimizer
from ringtrain.train.precision import Precision
from ringtrain.errors import ConfigError
from ringtrain.testing import faults
from ringtrain.train.user_parts import UserParts

__all__ = ["build_trainer", "planned_steps", "broadcast_from_rank0", "arm_fault_plan"]


def build_trainer(
    config: Config, ctx: DistContext, job_store: NullJobStore | None = None, parts: UserParts | None = None,
    healing: NoHealing | None = None, joining: bool = False,
) -> Trainer:
    """The trainer of ``config`` on ``parts`` (``fit``'s, or ``UserParts.from_config``: the config's
    factories or its built-in workload). ``healing``: the seams of a --heal job (ringtrain/heal/). ``joining``:
    a worker admitted into a running --heal job, built before its group forms: the module is not wrapped (no
    collective) until it has received the running workers' state (``Trainer.regroup``)."""
    run_dir = Path(config.run_dir)
    train_cfg = config.train
    validate_for_backend(config, ctx.backend)
    if ctx.env.fault_plan and not faults.is_armed():  # a test harness's fault plan: nothing in a user's run
        arm_fault_plan(ctx, healing)
    parts = parts if parts is not None else UserParts.from_config(config)
    data = parts.data_split()
    model = parts.build_model(train_cfg.seed)  # seeded: every rank builds the same weights
    if isinstance(parts.model, torch.nn.Module) and not joining:
        # A module built before fit(): rank 0's weights for every rank (a --heal joiner receives them in the
        # state the running workers send it: they run no broadcast here).
        broadcast_from_rank0(model)
    task = parts.task
    # The layout's mesh, then tensor/pipeline splits and one data-parallel strategy over its dp ranks; the model
    # split over tp (or pp) ranks: they read the same samples (ctx's data-parallel coordinates).
    parallel = build_parallel(config, ctx, model, tp_plan=parts.tp_plan, pp_split=parts.pp_split, wrap=not joining)
    ctx, strategy, wrapped = parallel.ctx, parallel.strategy, parallel.model
    if parts.optimizer is not None:
        optimizer = parts.optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    else:
        optimizer = build_optimizer(train_cfg, model.parameters())
    # The run directory records the optimizer and schedule the user's script made (the config's otherwise).
    config = record_optimizer(config, optimizer if parts.optimizer else None, parts.lr_scheduler)
    # Sharded strategies (zero1/2/3) step the same optimizer over this rank's shard only.
    optimizer = strategy.shard_optimizer(optimizer)
    sampler = ResumableSampler(len(data.train), train_cfg.global_batch_size, seed=train_cfg.seed)
    total_steps = planned_steps(config, sampler.steps_per_epoch)
    pin_memory = ctx.device.type == "cuda"

    def loaders(rank: int, world_size: int):
        """This rank's train and eval loaders in a group of ``world_size`` (healing builds them again)."""
        return build_train_loader(
            data.train,
            sampler,
            rank,
            world_size,
            num_workers=config.data.num_workers,
            pin_memory=pin_memory,
            collate_fn=data.collate_fn,
        ), None if data.test is None else build_eval_loader(
            data.test,
            rank,
            world_size,
            batch_size=train_cfg.local_batch_size * 4,
            num_workers=config.data.num_workers,
            collate_fn=data.collate_fn,
            pin_memory=pin_memory,
        )

    train_loader, eval_loader = loaders(ctx.dp_rank, ctx.dp_size)
    best = BestModel.from_config(train_cfg, run_dir, ctx.rank)
    # Before step 1: keep_best names a metric the evaluation makes (top5_accuracy is checked at the first one).
    best.check_names([*task.eval_metrics(torch.ones(len(task.eval_fields), dtype=torch.float64)), *parts.metrics],
                     has_eval_data=eval_loader is not None)
    parts = TrainParts(
        model=wrapped,
        module=model,
        strategy=strategy,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(train_cfg, optimizer, total_steps, parts.lr_scheduler),
        sampler=sampler,
        train_loader=train_loader,
        eval_loader=eval_loader,
        task=task,
        metrics=_on_device(parts.metrics, ctx.device),
        total_steps=total_steps,
        ledger=build_ledger(config.data.ledger, run_dir, len(data.train), ctx.rank, ctx.dp_group, ctx.data_leader),
        job_store=job_store or NullJobStore(),
        precision=Precision(train_cfg.precision, ctx.device),
        batcher=MicroBatcher(train_cfg, task, ctx.dp_rank, ctx.dp_size, ctx.device, ctx.dp_group,
                             count=strategy.microbatches, count_multiple=strategy.microbatch_multiple),
        data_stats=data.stats,
        checkpointed_blocks=parallel.checkpointed_blocks,
        best=best,
        loaders=loaders,
    )
    trainer = Trainer(config, ctx, parts, build_logger(config, ctx.rank, run_dir), healing)
    # The task warns (once) through rank 0's logger: a console line and a record.
    task.warn = lambda message: trainer.logger.log({"type": "warning", "message": message})
    warning = outer_step_warning(config, total_steps)
    if warning is not None and ctx.rank == 0 and (str(run_dir), warning) not in _warned:  # once (a heal rebuilds)
        _warned.add((str(run_dir), warning))
        print(f"ringtrain: warning: {warning}", file=sys.stderr, flush=True)  # before the logger starts
    return trainer


_warned: set[tuple[str, str]] = set()
"""The run-length warnings this process gave (run directory, line): each once, however often a heal rebuilds."""


def arm_fault_plan(ctx: DistContext, healing: NoHealing | None) -> None:
    """Arm the test's fault plan (ringtrain/testing/faults.py) in this worker, once, before anything is built
    (shm picks its path by it), as the rank it was launched as (its member id), if the test opted in beside
    it (``ctx.env.fault_plan_opt_in``: a plan alone is ignored with a warning); then drop both from the
    environment, so that no process this worker starts is armed."""
    where = healing.where() if healing is not None else {}
    faults.arm(ctx.env.fault_plan, opt_in=ctx.env.fault_plan_opt_in,
               **{"rank": ctx.rank, "member": ctx.rank, "generation": 0, **where})
    forget_fault_plan()


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every parameter and buffer as rank 0 has it (a module the user built before the process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _on_device(metrics: dict, device: torch.device) -> dict:
    return {name: metric.to(device) if hasattr(metric, "to") else metric for name, metric in metrics.items()}


def planned_steps(config: Config, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: all epochs, or fewer when train.max_steps says so."""
    planned = config.train.epochs * steps_per_epoch
    return min(planned, config.train.max_steps) if config.train.max_steps else planned
