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

from ringtrain.checkpoint.sharded import StoredShards
from ringtrain.comm.objects import every_rank
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
    shards, zero's stretches), for sharded checkpoints: they replace the parts named ``model`` and ``optimizer``.

    Where the data-parallel replicas differ between syncs (DiLoCo's outer loop, ``outer_loop.syncs_replicas``):
    the shared keys hold rank 0's replica's copy (``lowest_rank``: as a full checkpoint's model), and each rank
    writes its own too, as local tensors under ``replica.rank_R`` (a key only it holds). A resume at the layout
    that saved it reads each rank's own back (bit for bit); at another (another world size, other parts) every
    rank takes the shared copy, with one warning, as ``CommState`` does for a full checkpoint."""

    names = ("model", "optimizer")

    def __init__(self, strategy: ReplicatedStrategy, model: nn.Module, optimizer: torch.optim.Optimizer,
                 rank: int = 0, world_size: int = 1, warn: Callable[[str], None] | None = None):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.rank, self.world_size, self.warn = rank, world_size, warn or (lambda message: None)
        self.lowest_rank = strategy.outer_loop.syncs_replicas

    def sharded_state(self) -> dict[str, Any]:
        state = self.strategy.checkpoint_state(self.model, self.optimizer)
        if self.lowest_rank:
            state["replica"] = {f"rank_{self.rank}": _local(state)}
        return state

    def load_sharded_state(self, shards: StoredShards) -> None:
        if not self.lowest_rank:
            self.strategy.load_checkpoint_state(self.model, self.optimizer, shards.load)
            return
        replicas = shards.part("replica")
        own = replicas.part(f"rank_{self.rank}")

        def load(state: dict[str, Any]) -> None:
            mine = _local(state)  # views of the state's tensors: filling them fills the state
            saved_ranks = len({key.split(".", 1)[0] for key in replicas.stored})
            if every_rank(saved_ranks == self.world_size and own.holds(mine, exactly=True)):
                own.load(mine)
                return
            self.warn(f"the checkpoint holds each worker's own parameters and optimizer state for {saved_ranks} "
                      f"workers, which do not map onto this run's {self.world_size}: every worker starts from the "
                      "checkpoint's model and optimizer state (rank 0's replica's)")
            shards.load(state)

        self.strategy.load_checkpoint_state(self.model, self.optimizer, load)


def _local(state: Any) -> Any:
    """``state`` (nested dicts) with every DTensor as its local tensor (a view of it): what this rank holds."""
    if isinstance(state, dict):
        return {key: _local(value) for key, value in state.items()}
    return state.to_local() if hasattr(state, "to_local") else state


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
    collective: every rank calls state_dict), each rank takes its own on load. In a sharded checkpoint of a
    strategy whose replicas differ between syncs (DiLoCo) the per-rank state is not gathered: each rank writes its
    own parameters and optimizer state through DCP (``ShardedTensors``) and its error feedback with the outer
    state (``parallel/diloco_state.py``'s ``OuterState``)."""

    def __init__(self, strategy: ReplicatedStrategy, rank: int, world_size: int, warn: Callable[[str], None]):
        self.strategy, self.rank, self.world_size, self.warn = strategy, rank, world_size, warn

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_rank_states(self.strategy), "world_size": self.world_size}

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.strategy.outer_loop.syncs_replicas:
            return {"ranks": None, "world_size": self.world_size, "in_shards": True}, {}
        return self.state_dict(), {}

    def load_sharded_state_dict(self, plain: dict[str, Any], shards: StoredShards) -> None:
        if self.strategy.outer_loop.syncs_replicas:
            return  # each rank's own came with the model and optimizer (``ShardedTensors``), and its warning
        self.load_state_dict(plain)

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
