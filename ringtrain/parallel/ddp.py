"""Torch DistributedDataParallel as a ringtrain strategy, its all-reduce chosen by name (a comm hook)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from ringtrain.comm.hooks import comm_hook
from ringtrain.monitor.comm_timer import CommTimer

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
        comm_timer: CommTimer | None = None,
    ):
        self.device = device
        self.bucket_mb = bucket_mb
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.comm_timer = comm_timer or CommTimer()

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views into the communication buckets: no copy between the two after the all-reduce.
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb, gradient_as_bucket_view=True
        )
        if dist.get_world_size() == 1:
            # Alone, a worker's gradient already is the average: no round trip, and no lossy compression.
            state, hook = None, noop_hook
        else:
            state, hook = comm_hook(
                self.algorithm,
                chunk_kb=self.chunk_kb,
                powersgd_rank=self.powersgd_rank,
                powersgd_start_iter=self.powersgd_start_iter,
            )
        # Timed, to measure the communication (total, and the part backward waits for).
        ddp.register_comm_hook(state, self.comm_timer.wrap(hook))
        return ddp

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager:
        """Skip the gradient all-reduce for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: DistributedDataParallel) -> nn.Module:
        return model.module
