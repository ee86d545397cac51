"""The data-parallel strategy registry: one spec per strategy, read by everything that needs to know what a
strategy is or does (the config's checks, the heal, ``fit``'s result, the planner, the bench). No module
compares strategy names; a new strategy is one ``register`` call and its own file under ``parallel/``.

    spec = strategy_spec("zero2")
    spec.owner                  # 'dp_shard': it shards the model's state over the data-parallel ranks
    spec.heals, spec.reloads    # (True, True): healed by reloading the lost worker's shards
    strategy = spec.build(config.comm, device, diloco=config.diloco, heal=False)   # imports parallel/zero.py

A leaf: the standard library only (the class is imported when a strategy is built), so the config's checks
read the specs before any worker starts."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["StrategySpec", "register", "strategy_spec", "strategy_specs", "HEALABLE_ALGORITHMS"]

HEALABLE_ALGORITHMS = ("torch", "ring", "ring_chunked", "shm", "fp16", "bf16")
"""Gradient algorithms dist.heal supports: no state beyond what a new group rebuilds (shm: a fresh workspace)."""


@dataclass(frozen=True)
class StrategySpec:
    """What one data-parallel strategy is and what it runs beside."""

    name: str
    builder: str
    """``module:function`` making the strategy: ``function(comm, device, *, spec, diloco, heal, mesh)``."""
    owner: Literal["dp_replicate", "dp_shard"]
    """The data-parallel dimension it runs on: every rank holds the whole model (``dp_replicate``), or the
    model's state is sharded over the ranks (``dp_shard``)."""
    summary: str
    algorithms: tuple[str, ...]
    """The ``comm.algorithm`` values it runs its collectives with."""
    beside: frozenset[str] = frozenset()
    """What it composes with on the mesh: ``tp`` (tensor parallelism on the same ranks), ``pp`` (pipeline stages),
    ``cp`` (context-parallel groups: their gradients averaged with the data-parallel ranks'),
    ``hsdp`` (replicas of its shard groups: a second data-parallel dimension)."""
    dtensors: bool = False
    """Beside tensor parallelism it takes the split model's DTensor parameters as they are (FSDP2's fully_shard;
    ddp's whole replicas are FSDP2's replicate dimension); the others train each rank's local parts
    (``parallel/tensor_data.py``)."""
    heals: bool = False
    """``--heal`` heals a lost worker in place."""
    reloads: bool = False
    """The heal reloads the lost worker's shards from the newest sharded checkpoint (it held their only copy):
    needs sharded checkpoints; joiners are not admitted."""
    module_is_users: bool = False
    """After training, the user's module itself holds every trained parameter (``fit``'s result hands it back;
    otherwise the full weights are gathered into a new one)."""
    leaves_group: bool = False
    """The strategy's hooks hold the group: ``fit`` leaves it before handing the module back."""
    gathers_in_forward: bool = False
    """Parameters are gathered in every forward (a step has collectives before its end: no automatic
    micro-batch shrinking)."""
    replicas_are_model_groups: bool = False
    """Beside a split model (cp) one of its replicas is a whole model-parallel group, trained as one model, its
    replicas synchronised by the strategy itself (DiLoCo's outer steps between the groups): its builder gets the
    layout's mesh to find the groups."""
    sharded_checkpoints: bool = True
    """It writes sharded (and background) checkpoints."""
    default_bucket_mb: float = 25.0
    comm_volume: float = 1.0
    """Bytes a step moves per parameter, relative to one gradient all-reduce (the planner's cost model):
    gathering parameters and reduce-scattering gradients move 1.5x."""
    section: str | None = None
    """The config section of its own (``[diloco]``): recorded and digested only under this strategy."""
    options: dict[str, Any] = field(default_factory=dict)
    """The builder's own arguments (zero's stage)."""

    def build(self, comm: Any, device: Any, *, diloco: Any = None, heal: bool = False, mesh: Any = None) -> Any:
        """The strategy (``parallel/``'s class), made by its builder."""
        module, function = self.builder.split(":")
        return getattr(importlib.import_module(module), function)(comm, device, spec=self, diloco=diloco,
                                                                   heal=heal, mesh=mesh)


_REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` (a name registered twice is a programming error)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"strategy {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def strategy_spec(name: str) -> StrategySpec:
    """The spec of ``name``; ValueError naming the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; registered: {', '.join(_REGISTRY)}") from None


def strategy_specs() -> tuple[StrategySpec, ...]:
    return tuple(_REGISTRY.values())


_OWN = ("torch", "ring", "ring_chunked", "shm")
"""ringtrain's gradient algorithms (the backend's all-reduce, or ringtrain's ring / chunked ring / shared memory)."""

register(StrategySpec(
    "ddp", "ringtrain.parallel.ddp:from_config", "dp_replicate",
    "PyTorch's DDP, its gradient all-reduce a comm hook (comm.algorithm)",
    algorithms=(*_OWN, "fp16", "bf16", "powersgd"), beside=frozenset({"tp", "pp", "cp"}), dtensors=True, heals=True,
    module_is_users=True, leaves_group=True))
register(StrategySpec(
    "manual", "ringtrain.parallel.manual:from_config", "dp_replicate",
    "ringtrain's own buckets and all-reduce after backward", algorithms=_OWN, beside=frozenset({"tp", "pp", "cp"}),
    heals=True, module_is_users=True, leaves_group=True))
for _stage in (1, 2, 3):
    register(StrategySpec(
        f"zero{_stage}", "ringtrain.parallel.zero:from_config", "dp_shard",
        f"ZeRO stage {_stage}: {('optimizer state', 'optimizer state and gradients', 'optimizer state, gradients and parameters')[_stage - 1]} sharded",
        algorithms=_OWN, beside=frozenset({"tp", "cp", "pp"}), heals=True, reloads=True, module_is_users=_stage < 3,
        gathers_in_forward=_stage == 3, comm_volume=1.5 if _stage == 3 else 1.0,
        default_bucket_mb=4.0 if _stage < 3 else 25.0, options={"stage": _stage}))
register(StrategySpec(
    "fsdp", "ringtrain.parallel.fsdp:from_config", "dp_shard", "PyTorch's FSDP2 (fully_shard)",
    algorithms=("torch", "shm"), beside=frozenset({"tp", "pp", "cp", "hsdp"}), dtensors=True, gathers_in_forward=True,
    comm_volume=1.5))
register(StrategySpec(
    "diloco", "ringtrain.parallel.diloco:from_config", "dp_replicate",
    "DiLoCo: local steps, an outer step every sync_every", algorithms=_OWN,
    beside=frozenset({"tp", "pp", "cp"}), heals=True, module_is_users=True, leaves_group=True, replicas_are_model_groups=True,
    section="diloco"))
