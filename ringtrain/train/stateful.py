"""The trainer's parts that have state, each a ``Stateful`` (``state_dict`` / ``load_state_dict``), so a checkpoint
(checkpoint/front.py) and the heal's state transfer (heal/transfer.py) take one dict of them.

Most parts are Stateful already (the sampler, ``TrainState``, ``Precision``, ``MicroBatcher``); these adapt the
rest: the model and optimizer as a strategy holds them (full forms, which sharded strategies gather), the
optimizer's *state* only (its hyperparameters follow the config on resume), the lr schedule (positioned at the
step, never carried), PowerSGD's per-rank error feedback, and what a checkpoint says about the run that wrote
it (the optimizer's class and the config, checked and reported on load).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringtrain.config import Config
from ringtrain.errors import CheckpointError
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.train.comm_state import gather_rank_states
from ringtrain.train.optim import load_optimizer_state, optimizer_name, position_lr_scheduler
from ringtrain.train.resume import config_changes
from ringtrain.train.state import TrainState

__all__ = ["ModelState", "OptimizerState", "ShardedTensors", "ScheduleState", "CommState", "RunInfo"]


class ModelState:
    """The model in its full (unsharded) form, as one process holds it; a sharded strategy gathers it.
    ``strategy`` None: the bare module as this process holds it (a replicated one, outside any group)."""

    def __init__(self, strategy: ReplicatedStrategy | None, model: nn.Module):
        self.strategy, self.model = strategy, model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict() if self.strategy is None else self.strategy.model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.strategy is None:
            self.model.load_state_dict(state)
        else:
            self.strategy.load_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state (moments, momentum buffers, step counts) in full form. Loading keeps this run's
    hyperparameters (``keep_hyperparameters``: an optimizer built from the config, whose lr schedule is
    positioned at the step: a resume follows the config, ``--set train.lr=...`` included); an optimizer of the
    user's gets its saved param groups back, lr included, as its own scheduler expects. ``strategy`` None: the
    optimizer as this process holds it."""

    def __init__(self, strategy: ReplicatedStrategy | None, optimizer: torch.optim.Optimizer,
                 keep_hyperparameters: bool = True):
        self.strategy, self.optimizer = strategy, optimizer
        self.keep_hyperparameters = keep_hyperparameters

    def state_dict(self) -> dict[str, Any]:
        if self.strategy is None:
            return self.optimizer.state_dict()
        return self.strategy.optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.strategy is not None:
            state = self.strategy.shard_optimizer_state(self.optimizer, state)
        if self.keep_hyperparameters:
            load_optimizer_state(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)


class ShardedTensors:
    """The model's and optimizer's tensors in the layout the strategy holds them (replicated tensors, DTensor
    shards, zero's stretches), for sharded checkpoints: they replace the parts named ``model`` and ``optimizer``."""

    names = ("model", "optimizer")

    def __init__(self, strategy: ReplicatedStrategy, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer

    def sharded_state(self) -> dict[str, Any]:
        return self.strategy.checkpoint_state(self.model, self.optimizer)

    def load_sharded_state(self, load: Callable[[dict[str, Any]], None]) -> None:
        self.strategy.load_checkpoint_state(self.model, self.optimizer, load)


class ScheduleState:
    """The lr schedule, never carried: the lr at step s follows from the config and s, so a resume with a
    changed schedule or lr follows the new one. Loading positions it at the train state's step."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, state: TrainState):
        self.scheduler, self.state = scheduler, state

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position_lr_scheduler(self.scheduler, self.state.step)


class CommState:
    """Per-rank state of the gradient sync (PowerSGD's error feedback): gathered to rank 0 on save (a
    collective: every rank calls state_dict), each rank takes its own on load."""

    def __init__(self, strategy: ReplicatedStrategy, rank: int, world_size: int, warn: Callable[[str], None]):
        self.strategy, self.rank, self.world_size, self.warn = strategy, rank, world_size, warn

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_rank_states(self.strategy), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.strategy.has_rank_state:
            return
        saved, saved_world_size = state.get("ranks"), state.get("world_size")
        if not saved or saved_world_size != self.world_size:
            self.warn(f"the checkpoint holds no per-worker comm state (PowerSGD, DiLoCo) for {self.world_size} "
                      f"workers (it was saved by {saved_world_size}): PowerSGD's error feedback starts from zero, "
                      "DiLoCo's workers from the checkpoint's model")
            return
        self.strategy.load_state_dict(saved[self.rank])


class RunInfo:
    """What a checkpoint says about the run that wrote it. Loading refuses another optimizer class and reports
    the config fields that changed (``changes``); the new config wins."""

    def __init__(self, config: Config, optimizer: torch.optim.Optimizer, world_size: int):
        self.config, self.optimizer, self.world_size = config, optimizer, world_size
        self.changes: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_class": optimizer_name(self.optimizer), "world_size": self.world_size,
                "config": self.config.to_toml(), "config_digest": self.config.digest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizer_class")
        if saved is not None and saved != optimizer_name(self.optimizer):
            raise CheckpointError(
                f"the checkpoint's optimizer is {saved} but this run builds {optimizer_name(self.optimizer)}; "
                "resume with the checkpoint's optimizer, or start a new run (--resume-from loads the same state)")
        self.changes = config_changes(state["config"], self.config) if "config" in state else []
