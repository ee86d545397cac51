"""Data-parallel strategies: how gradients are synchronised across workers, and what each rank holds.

A strategy has ``wrap(model)``, ``no_sync(model)`` (a context that skips synchronisation for
accumulation micro-steps) and ``unwrap(model)``, plus what ``base.ReplicatedStrategy`` answers: the
optimizer over this rank's shard, where gradients live, the global-norm clip, the full (checkpoint) form of
the model and optimizer state, and the bytes of model state. The training loop only talks to that interface.

Replicated: 'ddp' (torch DDP), 'manual' (ringtrain's buckets); 'diloco' (``diloco.py``: no gradient sync,
an outer step on the averaged pseudo-gradient every H steps). Sharded: 'zero1', 'zero2', 'zero3'
(ringtrain's collectives, ``zero.py``), 'fsdp' (PyTorch's FSDP2, ``fsdp.py``). Model-parallel: ``[parallel] tp``
(``tensor.py``: DTensor's tensor parallelism of the built-in transformer, under FSDP2 on a 2-D mesh), ``[parallel]
pp`` (``pipeline.py``: torch's pipeline schedules over the built-in transformer's stages, replicas over dp).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch

from ringtrain.config import CommConfig, DiLoCoConfig
from ringtrain.config.parallel import ParallelConfig
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.errors import ConfigError
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.parallel.ddp import DDPStrategy
from ringtrain.parallel.diloco import DiLoCoStrategy
from ringtrain.parallel.fsdp import FSDPStrategy
from ringtrain.parallel.manual import ManualStrategy
from ringtrain.parallel.pipeline import PipelineStrategy
from ringtrain.parallel.tensor import TensorParallelStrategy
from ringtrain.parallel.zero import ZeroStrategy

__all__ = ["Strategy", "ReplicatedStrategy", "DDPStrategy", "ManualStrategy", "ZeroStrategy", "FSDPStrategy",
           "DiLoCoStrategy", "TensorParallelStrategy", "PipelineStrategy", "build_strategy"]


class Strategy(Protocol):
    """The interface; the methods after ``unwrap`` are ``ReplicatedStrategy``'s (documented there)."""

    name: str
    comm_timer: CommTimer
    """Times the gradient communication the strategy runs."""
    gradients_replicated: bool
    reduces_every_micro_batch: bool
    forward_is_collective: bool
    splits_model: bool
    step_operation: str

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module): ...

    def loss_context(self): ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...

    def take_step_comm_s(self) -> float: ...

    def gradient_parameters(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]: ...

    def clip_grad_norm_(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor: ...

    def full_parameters(self, model: torch.nn.Module): ...

    def full_named_parameters(self, model: torch.nn.Module) -> dict: ...

    def model_state_dict(self, model: torch.nn.Module) -> dict: ...

    def load_model_state_dict(self, model: torch.nn.Module, state: dict) -> None: ...

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict: ...

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict: ...

    def model_state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int: ...


def build_strategy(config: CommConfig, device: torch.device, diloco: DiLoCoConfig | None = None,
                   heal: bool = False, mesh=None, parallel: ParallelConfig | None = None,
                   tp_plan: Mapping[str, Any] | None = None, pp_split: Callable | None = None) -> Strategy:
    """The strategy ``config.strategy`` names (``diloco``: the [diloco] section, its defaults when None).
    ``heal``: a --heal job, whose DiLoCo replicas are single workers (``diloco.inner = 'auto'`` resolves so).
    ``mesh``: a (dp_replicate, dp_shard) mesh (``fsdp.hsdp_mesh``): FSDP2's HSDP; a (dp, tp) or (dp_replicate,
    dp_shard, tp) device mesh with tp > 1 (``tensor.mesh_context``): tensor parallelism, under FSDP2 on
    dp when dp > 1 (the config checks refused every other data-parallel strategy beside it), split by
    ``tp_plan`` (None: the model's own plan); a (dp, pp) or (dp, pp, tp) mesh
    (``pipeline.pipeline_mesh_context``): pipeline parallelism with ``parallel``'s schedule (its stages split
    over tp when the mesh has it; a user's model cut by ``pp_split``), its replicas averaged over dp (ddp or manual: one all-reduce of
    ``config.algorithm`` after the schedule) or its stages sharded over dp (fsdp)."""
    if mesh is not None and "pp" in (mesh.mesh_dim_names or ()):
        parallel = parallel or ParallelConfig()
        return PipelineStrategy(device, mesh, schedule=parallel.pp_schedule, microbatches=parallel.pp_microbatches,
                                stages_per_rank=parallel.stages_per_rank, shard=config.strategy == "fsdp",
                                algorithm=config.algorithm, chunk_kb=config.chunk_kb,
                                sequence_parallel=parallel.sequence_parallel, split=pp_split)
    if mesh is not None and "tp" not in (mesh.mesh_dim_names or ()):  # (dp_replicate, dp_shard): HSDP
        return FSDPStrategy(device, mesh=mesh)
    if mesh is not None:
        return TensorParallelStrategy(device, mesh, plan=tp_plan,
                                      sequence_parallel=bool(parallel and parallel.sequence_parallel),
                                      loss_parallel=bool(parallel and parallel.loss_parallel))
    if config.algorithm == "shm" and device.type != "cpu":
        # dist.backend = 'auto' resolves to NCCL only here, on a worker that found a GPU.
        raise ConfigError(
            f"comm.algorithm = 'shm' needs CPU workers but this worker trains on {device}; "
            "use comm.algorithm = 'ring' or 'torch', or dist.backend = 'gloo'"
        )
    if config.strategy == "ddp":
        return DDPStrategy(
            device,
            bucket_mb=config.resolved_bucket_mb,
            algorithm=config.algorithm,
            chunk_kb=config.chunk_kb,
            powersgd_rank=config.powersgd_rank,
            powersgd_start_iter=config.powersgd_start_iter,
        )
    if config.strategy == "manual":
        return ManualStrategy(device, bucket_mb=config.resolved_bucket_mb, algorithm=config.algorithm, chunk_kb=config.chunk_kb)
    if config.strategy in ("zero1", "zero2", "zero3"):
        return ZeroStrategy(device, stage=int(config.strategy[-1]), bucket_mb=config.resolved_bucket_mb,
                            algorithm=config.algorithm, chunk_kb=config.chunk_kb, prefetch=config.prefetch)
    if config.strategy == "fsdp":
        return FSDPStrategy(device)
    if config.strategy == "diloco":
        diloco = diloco or DiLoCoConfig()
        return DiLoCoStrategy(device, sync_every=diloco.sync_every, outer_lr=diloco.outer_lr,
                              outer_momentum=diloco.outer_momentum, nesterov=diloco.nesterov,
                              algorithm=config.algorithm, chunk_kb=config.chunk_kb, fragments=diloco.fragments,
                              delay=diloco.delay, dtype=diloco.dtype,
                              inner="worker" if heal and diloco.inner == "auto" else diloco.inner,
                              bucket_mb=config.resolved_bucket_mb)
    raise ValueError(f"unknown strategy {config.strategy!r}")  # unreachable: the config validates the name
