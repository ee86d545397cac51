"""Build the parts of a run, then hand them to the Trainer (torchtitan's build-then-wire shape)."""

from __future__ import annotations

from pathlib import Path

import torch

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import Config, validate_for_backend
from ringtrain.data import ResumableSampler, build_datasets, build_eval_loader, build_train_loader
from ringtrain.data.ledger import build_ledger
from ringtrain.dist.group import DistContext
from ringtrain.dist.jobstore import NullJobStore
from ringtrain.models import build_model
from ringtrain.monitor.loggers import build_logger
from ringtrain.parallel import build_strategy
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.train.loop import TrainParts, Trainer
from ringtrain.train.optim import build_lr_scheduler, build_optimizer
from ringtrain.train.precision import Precision
from ringtrain.train.tasks import build_task

__all__ = ["build_trainer", "planned_steps"]


def build_trainer(config: Config, ctx: DistContext, job_store: NullJobStore | None = None) -> Trainer:
    run_dir = Path(config.run_dir)
    train_cfg = config.train
    validate_for_backend(config, ctx.backend)
    # Same seed on every rank: identical initial weights (DDP would broadcast rank 0's anyway).
    torch.manual_seed(train_cfg.seed)
    data = build_datasets(config.data)
    model = build_model(config.model, data)
    strategy = build_strategy(config.comm, ctx.device)
    wrapped = strategy.wrap(model)
    optimizer = build_optimizer(train_cfg, model.parameters())
    sampler = ResumableSampler(len(data.train), train_cfg.global_batch_size, seed=train_cfg.seed)
    total_steps = planned_steps(config, sampler.steps_per_epoch)
    task = build_task(config.data.dataset)
    pin_memory = ctx.device.type == "cuda"
    parts = TrainParts(
        model=wrapped,
        strategy=strategy,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(train_cfg, optimizer, total_steps),
        sampler=sampler,
        train_loader=build_train_loader(
            data.train,
            sampler,
            ctx.rank,
            ctx.world_size,
            num_workers=config.data.num_workers,
            pin_memory=pin_memory,
            collate_fn=data.collate_fn,
        ),
        eval_loader=build_eval_loader(
            data.test,
            ctx.rank,
            ctx.world_size,
            batch_size=train_cfg.local_batch_size * 4,
            num_workers=config.data.num_workers,
            collate_fn=data.collate_fn,
            pin_memory=pin_memory,
        ),
        task=task,
        total_steps=total_steps,
        ledger=build_ledger(config.data.ledger, run_dir, len(data.train), ctx.rank),
        job_store=job_store or NullJobStore(),
        precision=Precision(train_cfg.precision, ctx.device),
        batcher=MicroBatcher(train_cfg, task, ctx.rank, ctx.world_size, ctx.device),
        data_stats=data.stats,
    )
    checkpoints = CheckpointManager(
        run_dir / config.checkpoint.dir, keep_last=config.checkpoint.keep_last, is_writer=ctx.rank == 0
    )
    return Trainer(config, ctx, parts, build_logger(config, ctx.rank, run_dir), checkpoints)


def planned_steps(config: Config, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: all epochs, or fewer when train.max_steps says so."""
    planned = config.train.epochs * steps_per_epoch
    return min(planned, config.train.max_steps) if config.train.max_steps else planned
