"""Torch DistributedDataParallel as a ringtrain strategy."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DDPStrategy"]


class DDPStrategy:
    """Wraps the model in DDP; gradients are averaged across workers during backward."""

    name = "ddp"

    def __init__(self, device: torch.device, bucket_mb: float = 25.0):
        self.device = device
        self.bucket_mb = bucket_mb

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb)

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager:
        """Skip the gradient all-reduce for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: DistributedDataParallel) -> nn.Module:
        return model.module
