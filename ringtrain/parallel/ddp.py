"""Torch DistributedDataParallel as a ringtrain strategy."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ringtrain.monitor.comm_timer import CommTimer

__all__ = ["DDPStrategy"]


class DDPStrategy:
    """Wraps the model in DDP; gradients are averaged across workers during backward."""

    name = "ddp"

    def __init__(self, device: torch.device, bucket_mb: float = 25.0, comm_timer: CommTimer | None = None):
        self.device = device
        self.bucket_mb = bucket_mb
        self.comm_timer = comm_timer or CommTimer()

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views into the communication buckets: no copy between the two after the all-reduce.
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb, gradient_as_bucket_view=True
        )
        # torch's own all-reduce hook (what DDP does without one), timed to measure communication.
        # Alone, a worker's gradient already is the average: skip the round trip through the backend.
        hook = allreduce_hook if dist.get_world_size() > 1 else noop_hook
        ddp.register_comm_hook(None, self.comm_timer.wrap(hook))
        return ddp

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager:
        """Skip the gradient all-reduce for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: DistributedDataParallel) -> nn.Module:
        return model.module
