"""Distributed evaluation: each rank scores its shard, one all-reduce adds the sums."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ringtrain.train.tasks import Task

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: DataLoader,
    task: Task,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> dict:
    """Metrics over the whole test set. ``module`` is the unwrapped model: a DDP forward would run
    collectives, and ranks may hold different numbers of eval batches. ``autocast`` gives the training
    precision's context (the sums themselves are fp64)."""
    was_training = module.training
    module.eval()
    sums = torch.zeros(len(task.eval_fields), dtype=torch.float64, device=device)
    for inputs, targets in loader:
        targets = targets.to(device)
        with autocast():
            outputs = module(inputs.to(device))
        sums += task.eval_sums(outputs, targets).to(device)
    dist.all_reduce(sums)
    module.train(was_training)
    return task.eval_metrics(sums.cpu())
