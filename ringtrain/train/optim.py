"""Optimizer and learning-rate schedule builders."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ringtrain.config import TrainConfig

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_factor", "load_optimizer_state", "position_lr_scheduler",
           "optimizer_name"]


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak lr at optimizer step ``step``: linear warm-up, then constant or cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class _Schedule:
    """The lr lambda. Its numbers come from the config of the run that uses it: a checkpoint does not hold
    the scheduler (see ``position_lr_scheduler``), so a resume with a changed ``max_steps`` or
    ``lr_schedule`` follows the new plan."""

    def __init__(self, total_steps: int, warmup_steps: int, schedule: str):
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.schedule = schedule

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.total_steps, self.warmup_steps, self.schedule)


def build_lr_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """Stepped once per optimizer step (not per micro-batch)."""
    return LambdaLR(optimizer, _Schedule(total_steps, config.warmup_steps, config.lr_schedule))


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """``module.Class`` of the optimizer, as a checkpoint records it."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load the optimizer's *state* (moments, momentum buffers, step counts) from a checkpoint, keeping
    the hyperparameters (lr, initial_lr, weight_decay, momentum, betas, ...) this run was built with.

    ``Optimizer.load_state_dict`` restores the saved param groups' hyperparameters too, which would make a
    resume ignore ``--set train.lr=...``; the current config wins, as a fresh run's would.
    """
    fresh = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, hyperparameters in zip(optimizer.param_groups, fresh):
        group.update(hyperparameters)


def position_lr_scheduler(scheduler: LambdaLR, step: int) -> None:
    """Put ``scheduler`` where a fresh run of this config is after ``step`` optimizer steps: the lr of
    every param group is ``base_lr * schedule(step)``, as ``step`` calls of ``scheduler.step()`` leave it."""
    scheduler.last_epoch = step
    lrs = [base * schedule(step) for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns; torch keeps it in this attribute
