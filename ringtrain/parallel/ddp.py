"""Torch DistributedDataParallel as a ringtrain strategy, its all-reduce chosen by name (a comm hook)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringtrain.comm.hooks import register_comm_hook

__all__ = ["DDPStrategy"]


class DDPStrategy:
    """Wraps the model in DDP; gradients are averaged across workers during backward.

    ``algorithm`` picks DDP's communication hook: 'torch' (DDP's own all-reduce), ringtrain's 'ring',
    'ring_chunked', 'shm', or torch's 'fp16', 'bf16', 'powersgd' (``ringtrain.comm.hooks``).
    """

    name = "ddp"

    def __init__(
        self,
        device: torch.device,
        bucket_mb: float = 25.0,
        algorithm: str = "torch",
        chunk_kb: int | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
    ):
        self.device = device
        self.bucket_mb = bucket_mb
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb)
        register_comm_hook(
            ddp,
            self.algorithm,
            chunk_kb=self.chunk_kb,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
        )
        return ddp

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager:
        """Skip the gradient all-reduce for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: DistributedDataParallel) -> nn.Module:
        return model.module
