"""Optimizer and learning-rate schedule builders.

ringtrain's own: SGD or AdamW from [train], and a LambdaLR of warm-up + constant or cosine decay whose lr at
step s follows from the config and s (a checkpoint holds no scheduler). A user's optimizer class
(``train.optimizer = "package.module:Class"``) and scheduler function (``train.lr_schedule``, fit's
``lr_scheduler``) are built here too, and recorded by ``record_optimizer`` when fit() was handed them.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ringtrain.config import Config, TrainConfig
from ringtrain.errors import CheckpointError, ConfigError

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_factor", "load_optimizer_state", "position_lr_scheduler",
           "optimizer_name", "record_optimizer"]


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    from ringtrain.train.user_parts import import_callable

    cls = import_callable("train.optimizer", config.optimizer)
    try:
        optimizer = cls(params, lr=config.lr, **config.optimizer_args)
    except TypeError as err:
        raise ConfigError(f"train.optimizer = '{config.optimizer}' cannot be built with lr and train.optimizer_args "
                          f"{sorted(config.optimizer_args)} ({err})") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"train.optimizer = '{config.optimizer}' made a {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer")
    return optimizer


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


def build_lr_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                       user: Callable[[torch.optim.Optimizer], LRScheduler] | None = None) -> LRScheduler:
    """Stepped once per optimizer step (not per micro-batch): ``user(optimizer)`` (fit's ``lr_scheduler``), the
    function ``lr_schedule`` names, or ringtrain's warm-up + constant / cosine of the optimizer's lr."""
    if user is None and config.lr_schedule in ("constant", "cosine"):
        return LambdaLR(optimizer, _Schedule(total_steps, config.warmup_steps, config.lr_schedule))
    if user is None:
        from ringtrain.train.user_parts import import_callable

        user = import_callable("train.lr_schedule", config.lr_schedule)
    scheduler = user(optimizer)
    if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not optimizer:
        what = type(scheduler).__name__ if not isinstance(scheduler, LRScheduler) else "an LRScheduler of another optimizer"
        raise ConfigError(f"lr_scheduler returned {what}; it must return a torch.optim.lr_scheduler.LRScheduler "
                          "built on the optimizer it is given, e.g. lambda opt: StepLR(opt, step_size=100)")
    return scheduler


def record_optimizer(config: Config, optimizer: torch.optim.Optimizer | None,
                     lr_scheduler: Callable | None) -> Config:
    """``config`` as the run directory records it when the user's script built the optimizer or the schedule
    (fit's ``optimizer`` / ``lr_scheduler``): train.optimizer the optimizer's class, train.lr its lr,
    train.optimizer_args its other constructor arguments (``optimizer.defaults``: the values TOML can hold;
    param groups' own values are the script's), train.lr_schedule the scheduler function's import path."""
    from ringtrain.train.user_parts import describe_callable

    update: dict = {}
    if optimizer is not None:
        defaults = dict(optimizer.defaults)
        update["lr"] = float(_plain(defaults.pop("lr", config.train.lr)))
        # What its constructor takes (AdamW's defaults hold Adam's decoupled_weight_decay, which it does not).
        try:
            taken = set(inspect.signature(type(optimizer).__init__).parameters)
        except (TypeError, ValueError):
            taken = set(defaults)
        update["optimizer_args"] = {key: _plain(value) for key, value in defaults.items()
                                    if key in taken and _plain(value) is not None}
        update["optimizer"] = describe_callable(type(optimizer))
    if lr_scheduler is not None:
        update["lr_schedule"] = describe_callable(lr_scheduler)
    return config.model_copy(update={"train": config.train.model_copy(update=update)}) if update else config


def _plain(value):
    """A hyperparameter as TOML holds it (a tensor lr as its float), or None: left out (None, objects)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return items if all(item is not None for item in items) else None
    return None


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


def position_lr_scheduler(scheduler: LRScheduler, step: int) -> None:
    """Put ``scheduler`` where a fresh run of this config is after ``step`` optimizer steps: the lr of
    every param group is ``base_lr * schedule(step)``, as ``step`` calls of ``scheduler.step()`` leave it.

    A user's scheduler (fit's ``lr_scheduler``, or a function ``lr_schedule`` names) may compute each lr from
    the last (StepLR, OneCycleLR): it is stepped from where it stands to ``step``, the same calls on the same
    floats as the uninterrupted run made, so its lr is the same bits (a checkpoint holds no scheduler). It is
    never moved back: a trainer that is ahead is built again instead (healing reloads build a new one)."""
    if not isinstance(getattr(scheduler, "lr_lambdas", [None])[0], _Schedule):
        if scheduler.last_epoch > step:
            raise CheckpointError(f"the lr scheduler stands at step {scheduler.last_epoch}, past step {step}: a user's "
                                  "scheduler cannot be moved back")
        with warnings.catch_warnings():  # stepping before any optimizer step is the point here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step - scheduler.last_epoch):
                scheduler.step()
        return
    scheduler.last_epoch = step
    lrs = [base * schedule(step) for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns; torch keeps it in this attribute
