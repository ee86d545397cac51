"""Data-parallel strategies: how gradients are synchronised across workers, and what each rank holds.

A strategy has ``wrap(model)``, ``no_sync(model)`` (a context that skips synchronisation for
accumulation micro-steps) and ``unwrap(model)``, plus what ``base.ReplicatedStrategy`` answers: the
optimizer over this rank's shard, where gradients live, the global-norm clip, the full (checkpoint) form of
the model and optimizer state, and the bytes of model state. The training loop only talks to that interface.

Replicated: 'ddp' (torch DDP), 'manual' (ringtrain's buckets); 'diloco' (``diloco.py``: no gradient sync,
an outer step on the averaged pseudo-gradient every H steps). Sharded: 'zero1', 'zero2', 'zero3'
(ringtrain's collectives, ``zero.py``), 'fsdp' (PyTorch's FSDP2, ``fsdp.py``). Model-parallel: ``[parallel] tp``
(``tensor.py``: DTensor's tensor parallelism of the built-in transformer, under FSDP2 on a 2-D mesh; beside manual,
zero1-3 or DDP over dp x cp, ``tensor_data.py``: those strategies on each rank's local part), ``[parallel]
pp`` (``pipeline.py``: torch's pipeline schedules over the built-in transformer's stages, replicas over dp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from ringtrain.config import CommConfig, Config, DiLoCoConfig
from ringtrain.config.parallel import ParallelConfig, resolve_layout
from ringtrain.group.init import DistContext
from ringtrain.layout import Layout
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.errors import ConfigError
from ringtrain.parallel.activation_checkpoint import apply_ac
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.parallel.context_split import split_context
from ringtrain.parallel.ddp import DDPStrategy
from ringtrain.parallel.diloco import DiLoCoStrategy
from ringtrain.parallel.fsdp import FSDPStrategy
from ringtrain.parallel.manual import ManualStrategy
from ringtrain.parallel.outer_loop import NO_OUTER_LOOP, OuterLoop
from ringtrain.parallel.pipeline import PipelineStrategy
from ringtrain.parallel.tensor import TensorParallelStrategy
from ringtrain.parallel.tensor_data import TensorBesideData
from ringtrain.parallel.zero import ZeroStrategy
from ringtrain.strategies import strategy_spec
from ringtrain.testing import faults

__all__ = ["Strategy", "ReplicatedStrategy", "DDPStrategy", "ManualStrategy", "ZeroStrategy", "FSDPStrategy",
           "DiLoCoStrategy", "TensorParallelStrategy", "PipelineStrategy", "Parallel", "build_strategy",
           "build_parallel"]


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
    pipelined: bool
    has_rank_state: bool
    microbatches: int | None
    microbatch_multiple: int
    outer_loop: OuterLoop
    """DiLoCo's outer loop (``outer_loop.py``), a null one for strategies whose ranks are in step every step."""

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

    def collective_wait_s(self) -> float: ...

    def close(self) -> None: ...


def build_strategy(config: CommConfig, device: torch.device, diloco: DiLoCoConfig | None = None,
                   heal: bool = False, mesh=None, parallel: ParallelConfig | None = None,
                   tp_plan: Mapping[str, Any] | None = None, pp_split: Callable | None = None,
                   layout: Layout | None = None) -> Strategy:
    """The strategy of ``config.strategy`` on ``layout`` (None: every rank a data rank of its own), its
    spec's builder from the registry (``ringtrain/strategies.py``; ``diloco``: the [diloco] section, its
    defaults when None; ``heal``: a --heal job). ``mesh``: the layout's device mesh (``Layout.build_mesh``,
    carried by the DistContext): with pp > 1 the pipeline over its stages (``parallel``'s schedule, its stages
    split over tp when the mesh has it, a user's model cut by ``pp_split``), with tp > 1 tensor parallelism (split
    by ``tp_plan``; None: the model's own plan), each with the data-parallel strategy over the mesh's ``dp``
    ranks; else the data-parallel strategy alone (FSDP2 on the 2-D mesh of HSDP). The config's checks refused
    every combination the strategy's spec does not run beside."""
    spec = strategy_spec(config.strategy)
    parallel = parallel or ParallelConfig()
    layout = layout or Layout(owner=spec.owner)
    outer_loop = NO_OUTER_LOOP
    if spec.replicas_are_model_groups and (layout.pp > 1 or layout.tp > 1):
        # DiLoCo beside tp or pp: a replica is a tp group or a pipeline, which steps with its own collectives; the
        # outer loop over the dp ranks is attached to the parts the split model's strategy makes (its wrap).
        outer_loop = spec.build(config, device, diloco=diloco, heal=heal).outer_loop
    if layout.pp > 1:
        # ringtrain's ZeRO (a spec with a stage) wraps each stage; FSDP2 shards them; the replicas' all-reduce is
        # the pipeline's own.
        zero = spec.build(config, device) if "stage" in spec.options else None
        return PipelineStrategy(device, mesh, schedule=parallel.pp_schedule, microbatches=parallel.pp_microbatches,
                                stages_per_rank=parallel.stages_per_rank,
                                shard=spec.owner == "dp_shard" and zero is None,
                                algorithm=config.algorithm, chunk_kb=config.chunk_kb,
                                sequence_parallel=parallel.sequence_parallel, split=pp_split, outer_loop=outer_loop,
                                zero=zero, loss_parallel=parallel.loss_parallel)
    if layout.tp > 1:
        # The gradients are averaged over the dp ranks, or beside context parallelism over the dp x cp ranks (the cp
        # ranks' shares). FSDP2 takes the split model's DTensors (ddp's whole replicas: its replicate dimension, on
        # the 2-D mesh built beside tp alone; HSDP's two dimensions beside cp: replicas of dp_shard x cp shard
        # groups); the others train its local parts (tensor_data.py). DiLoCo's replicas are tp groups: the outer
        # loop (above) is attached to the split model's parts.
        tensor = dict(plan=tp_plan, sequence_parallel=parallel.sequence_parallel, loss_parallel=parallel.loss_parallel)
        if outer_loop is not NO_OUTER_LOOP:
            return TensorParallelStrategy(device, mesh, outer_loop=outer_loop, **tensor)
        if spec.dtensors and (spec.owner == "dp_shard" or layout.cp == 1):
            fsdp_mesh = None
            if layout.cp > 1:
                fsdp_mesh = mesh[("dp_replicate", "dp_shard_cp")] if layout.hsdp else mesh["dp_cp"]
            return TensorParallelStrategy(device, mesh, dp_mesh=fsdp_mesh, **tensor)
        data = spec.build(config, device, diloco=diloco, heal=heal, mesh=mesh["dp_cp"] if layout.cp > 1 else mesh["dp"])
        return TensorBesideData(device, mesh, data=data, **tensor)
    if config.algorithm == "shm" and device.type != "cpu":
        # dist.backend = 'auto' resolves to NCCL only here, on a worker that found a GPU.
        raise ConfigError(
            f"comm.algorithm = 'shm' needs CPU workers but this worker trains on {device}; "
            "use comm.algorithm = 'ring' or 'torch', or dist.backend = 'gloo'"
        )
    if layout.hsdp and layout.cp > 1:  # FSDP2's HSDP over replicas of (dp_shard x cp)-rank shard groups
        mesh = mesh[("dp_replicate", "dp_shard_cp")]
    # DiLoCo beside context parallelism: a replica is a cp group, found on the mesh.
    groups = spec.replicas_are_model_groups and layout.model_parallel > 1
    return spec.build(config, device, diloco=diloco, heal=heal, mesh=mesh if layout.hsdp or groups else None)


def build_parallel(config: Config, ctx: DistContext, model: torch.nn.Module, *, tp_plan: Mapping[str, Any] | None = None,
                   pp_split: Callable | None = None, wrap: bool = True) -> Parallel:
    """The one way in to parallelism, for every way in (built-in workloads, factories, ``fit``, the Session):
    ``config``'s layout resolved at ``ctx``'s world size and its mesh built (``ctx.on_layout``), then, in a fixed
    order on that mesh, the context-parallel split (cp > 1: ``context_split.py``), activation checkpointing of
    ``model``'s blocks (before any wrapper, so DDP, the zero units and FSDP's fully_shard see checkpointed
    blocks) and the strategy (tensor and pipeline splits with one data-parallel strategy over the ``dp`` ranks), which wraps the model unless ``wrap`` is false (a --heal
    joiner, wrapped when it has the running workers' state). Every rank calls it."""
    layout = resolve_layout(config.parallel, config.comm.strategy, ctx.world_size)
    ctx = ctx.on_layout(layout, config.parallel.tp_algorithm)
    if layout.cp > 1:  # the sequence split: ring attention in every block, the logits gathered back
        # (Under pp the model's own hooks never run: the pipeline calls its stages, whose first shards the tokens
        # and whose last gathers the logits, pipeline.SequenceSplit; the blocks' ring attention is this one.)
        split_context(model, ctx.mesh["cp"].get_group())
    checkpointed = apply_ac(model, config.train.activation_checkpointing)
    strategy = build_strategy(config.comm, ctx.device, config.diloco, heal=config.dist.heal, mesh=ctx.mesh,
                              parallel=config.parallel, tp_plan=tp_plan, pp_split=pp_split, layout=layout)
    if wrap:
        faults.point("train.wrap")
    return Parallel(ctx, strategy, strategy.wrap(model) if wrap else model, len(checkpointed))


@dataclass
class Parallel:
    """What ``build_parallel`` made: the context on the layout (its mesh, this rank's data-parallel
    coordinates), the strategy, the model it wrapped (the module itself when not wrapped) and how many blocks
    activation checkpointing wrapped."""

    ctx: DistContext
    strategy: Strategy
    model: torch.nn.Module
    checkpointed_blocks: int
