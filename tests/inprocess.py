"""The trainer ``ringtrain train`` builds, built inside a ``run_distributed`` rank instead of a launched worker:
for reference runs that a chaos test compares a real, interrupted job against, and for tests that inject
faults into a part (a task returning NaN).

    params = run_distributed(train_uninterrupted, 2, "configs/debug_mlp.toml", ["train.epochs=4"], str(run_dir))[0]
"""

from __future__ import annotations

import numpy as np
import torch

from ringtrain.config import load_config
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import DistContext
from ringtrain.train.build import build_trainer
from ringtrain.train.loop import Trainer
from ringtrain.train.resume import ResumePlan

__all__ = ["trainer_here", "params_of", "train_uninterrupted"]


def trainer_here(rank: int, world_size: int, config_path: str, overrides: list[str], run_dir: str) -> Trainer:
    config = load_config(config_path, overrides, run_dir=run_dir)
    env = DistEnv(rank=rank, world_size=world_size, local_world_size=world_size)
    return build_trainer(config, DistContext(env, "gloo", torch.device("cpu"), rank, world_size))


def params_of(trainer: Trainer) -> dict[str, np.ndarray]:
    # As numpy arrays: tensors would cross the result queue as shared memory of a process about to exit.
    return {name: p.detach().numpy().copy() for name, p in trainer.module.named_parameters()}


def train_uninterrupted(rank: int, world_size: int, config_path: str, overrides: list[str], run_dir: str):
    """Train the job start to finish; return this rank's final parameters."""
    trainer = trainer_here(rank, world_size, config_path, overrides, run_dir)
    trainer.resume(ResumePlan.fresh())
    trainer.fit()
    return params_of(trainer)
