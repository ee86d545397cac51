"""The job's layout: how its ranks divide the work, resolved once, validated once, and the one place its device
mesh is built (torchtitan's ``ParallelDims``).

    layout = Layout.resolve({"tp": 2}, owner="dp_shard", world_size=8)
    layout.degrees                 # {'dp_replicate': 1, 'dp_shard': 4, 'cp': 1, 'tp': 2, 'pp': 1}
    mesh = layout.build_mesh("cpu")   # dims ('dp', 'tp'); None when every rank is a data rank of its own

The degrees, outermost first: ``dp_replicate`` (whole replicas, or replicas of shard groups: HSDP),
``dp_shard`` (ranks sharding the model's state), ``pp`` (pipeline stages), ``cp`` (sequence shards), ``tp``
(tensor shards); their product is the world size. The ranks of one tensor-, context- or pipeline-parallel group
are consecutive (innermost), so a tensor-parallel group stays on one host. The data-parallel ranks (the ones
that read different samples) are the ``dp_replicate x dp_shard`` ranks; the ranks of one model-parallel group
(``pp x cp x tp``) read the same samples, and the first of them speaks for them in sums over ranks
(``data_leader``).

This module imports no torch until a mesh is built: the config's checks (``config/parallel.py``) resolve a
layout before any worker starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ringtrain.errors import ConfigError

__all__ = ["Layout", "DIMS", "DATA_DIMS", "MODEL_DIMS"]

DIMS = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
"""The mesh's dimensions, outermost first."""
DATA_DIMS = ("dp_replicate", "dp_shard")
"""The dimensions whose ranks read different samples."""
MODEL_DIMS = ("pp", "cp", "tp")
"""The dimensions whose ranks split one model replica (and read the same samples)."""

Owner = Literal["dp_replicate", "dp_shard"]


@dataclass(frozen=True)
class Layout:
    """The degrees of a job's mesh; ``owner`` is the data-parallel dimension the strategy runs on (a replicating
    strategy's ``dp_replicate``, a sharding one's ``dp_shard``): with ``dp_shard`` as owner and ``dp_replicate``
    > 1, replicas of shard groups (FSDP2's HSDP)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    owner: Owner = "dp_replicate"

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"[parallel] {name} = {value!r}: a resolved degree is a number of ranks (1 or more)")
        if self.owner not in DATA_DIMS:
            raise ConfigError(f"a layout's data-parallel owner is one of {DATA_DIMS}, not {self.owner!r}")

    @classmethod
    def resolve(cls, given: dict[str, int | None], owner: Owner, world_size: int) -> Layout:
        """The layout at ``world_size`` from the degrees the config gives (``None``: unset; -1: the ranks the
        others leave). An unset ``owner`` takes the rest (unless another degree does); the other unset ones are 1.
        ConfigError, naming every degree, when they cannot multiply to ``world_size``."""
        given = {name: given.get(name) for name in DIMS}
        someone_takes_rest = -1 in given.values()
        degrees = {name: (value if value is not None else -1 if name == owner and not someone_takes_rest else 1)
                   for name, value in given.items()}
        rest = [name for name, value in degrees.items() if value == -1]
        known = math.prod(value for value in degrees.values() if value != -1)
        named = " x ".join(f"{name} ({'-1: the rest' if degrees[name] == -1 else degrees[name]})"
                           for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if name != "cp" or degrees[name] != 1)
        if rest:
            if world_size % known:
                raise ConfigError(f"[parallel] {named}: {known} does not divide world_size ({world_size}), so "
                                  f"{rest[0]} cannot take the rest; change the degrees or the number of workers")
            degrees[rest[0]] = world_size // known
        elif known != world_size:
            raise ConfigError(f"[parallel] {named} = {known}, but world_size is {world_size}: the degrees must "
                              "multiply to the number of workers; change one, or set one to -1 (the rest)")
        return cls(**degrees, owner=owner)

    # --- what the degrees say ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel degree: the ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """The ranks that split one model replica (pp x cp x tp; 1: every rank holds the whole model)."""
        return self.pp * self.cp * self.tp

    @property
    def hsdp(self) -> bool:
        """Replicas of shard groups (FSDP2's 2-D data-parallel mesh)."""
        return self.owner == "dp_shard" and self.dp_replicate > 1

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}

    def describe(self) -> str:
        """The degrees above 1, as one would say them: ``dp_shard 2 x tp 2`` (``1 worker`` for none)."""
        parts = [f"{name} {getattr(self, name)}" for name in DIMS if getattr(self, name) > 1]
        return " x ".join(parts) or "1 worker"

    @property
    def needs_mesh(self) -> bool:
        """A device mesh is built: the model is split (pp, cp, tp), or the data-parallel ranks form two
        dimensions (HSDP). Otherwise every rank is a data rank of its own over the default group."""
        return self.model_parallel > 1 or self.hsdp

    # --- the mesh ------------------------------------------------------------------------------------------
    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The mesh's dimension names and sizes: the data-parallel ranks as one ``dp`` dimension (or, for HSDP
        and for whole replicas beside tp, ``dp_replicate, dp_shard``), then the model-parallel degrees above 1,
        outermost first. A dimension of size 1 is kept only where the strategies beside it index it (``dp``)."""
        if (self.dp_replicate > 1 and (self.hsdp or self.tp > 1)
                and (self.pp == 1 or (self.hsdp and self.cp == 1))  # HSDP beside a pipeline (its stages split by tp too)
                and (self.cp == 1 or self.hsdp)):
            # FSDP2's 2-D data-parallel mesh (replicas of shard groups; shard groups of 1 rank: whole replicas).
            names, sizes = ["dp_replicate", "dp_shard"], [self.dp_replicate, self.dp_shard]
        else:
            names, sizes = ["dp"], [self.dp]
        for name in MODEL_DIMS:
            if getattr(self, name) > 1:
                names.append(name)
                sizes.append(getattr(self, name))
        return tuple(names), tuple(sizes)

    def build_mesh(self, device_type: str, tp_backend: str | None = None) -> Any:
        """The job's one device mesh (``torch.distributed.device_mesh.DeviceMesh``), or None when
        ``needs_mesh`` is false; every rank calls it. ``tp_backend``: a torch.distributed backend for the ``tp``
        dimension's groups (ringtrain's shared-memory one), the default group's otherwise. With two data-parallel
        dimensions beside a split model they are also flattened into ``dp`` (the ranks that read different samples)."""
        if not self.needs_mesh:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        override = {"tp": tp_backend} if tp_backend and self.tp > 1 else None
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names,
                                **({"backend_override": override} if override else {}))
        if "dp_replicate" in names and self.model_parallel > 1:
            mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        if self.cp > 1 and (self.tp > 1 or self.pp > 1):  # a wrapper's gradient average beside a split model
            mesh[("dp_replicate", "dp_shard", "cp") if "dp_replicate" in names else ("dp", "cp")]._flatten("dp_cp")
        if self.cp > 1 and "dp_replicate" in names:  # HSDP beside cp (and tp): each shard group is dp_shard x cp ranks
            mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        return mesh
