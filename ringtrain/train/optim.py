"""Optimizer and learning-rate schedule builders."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ringtrain.config import TrainConfig

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_factor"]


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
    """A picklable lr lambda (LambdaLR saves callable objects' state, so resumes keep the schedule)."""

    def __init__(self, total_steps: int, warmup_steps: int, schedule: str):
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.schedule = schedule

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.total_steps, self.warmup_steps, self.schedule)


def build_lr_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """Stepped once per optimizer step (not per micro-batch)."""
    return LambdaLR(optimizer, _Schedule(total_steps, config.warmup_steps, config.lr_schedule))
