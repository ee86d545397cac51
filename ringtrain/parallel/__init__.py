"""Data-parallel strategies: how gradients are synchronised across workers.

A strategy has ``wrap(model)``, ``no_sync(model)`` (a context that skips synchronisation for
accumulation micro-steps) and ``unwrap(model)``. The training loop only talks to that interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ringtrain.config import CommConfig
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.errors import ConfigError
from ringtrain.parallel.ddp import DDPStrategy
from ringtrain.parallel.manual import ManualStrategy

__all__ = ["Strategy", "DDPStrategy", "ManualStrategy", "build_strategy"]


class Strategy(Protocol):
    name: str
    comm_timer: CommTimer
    """Times the gradient communication the strategy runs."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module): ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module: ...


def build_strategy(config: CommConfig, device: torch.device) -> Strategy:
    if config.algorithm == "shm" and device.type != "cpu":
        # dist.backend = 'auto' resolves to NCCL only here, on a worker that found a GPU.
        raise ConfigError(
            f"comm.algorithm = 'shm' needs CPU workers but this worker trains on {device}; "
            "use comm.algorithm = 'ring' or 'torch', or dist.backend = 'gloo'"
        )
    if config.strategy == "ddp":
        return DDPStrategy(
            device,
            bucket_mb=config.bucket_mb,
            algorithm=config.algorithm,
            chunk_kb=config.chunk_kb,
            powersgd_rank=config.powersgd_rank,
            powersgd_start_iter=config.powersgd_start_iter,
        )
    if config.strategy == "manual":
        return ManualStrategy(device, bucket_mb=config.bucket_mb, algorithm=config.algorithm, chunk_kb=config.chunk_kb)
    raise ValueError(f"unknown strategy {config.strategy!r}")  # unreachable: the config validates the name
