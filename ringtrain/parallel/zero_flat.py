"""The flat layout of the ZeRO strategies: parameters in units of one flat tensor, each rank owning one shard.

A ``FlatUnit`` lays its parameters end to end and cuts the flat tensor with ``comm.tensor_shards`` (the cut
every ringtrain collective uses), so ``reduce_scatter`` leaves rank r holding shard r of the gradient and
``all_gather`` fills every rank's parameters from their owners. The optimizer steps *runs*: parameters that
are this rank's shard of the unit, cut where the optimizer's param groups change (so per-group
hyperparameters such as weight decay still apply), built by ``shard_optimizer`` from the optimizer the user
or the config made for the full model.

Optimizer state is elementwise (SGD's momentum, Adam's moments) and shaped like the runs; to and from the
checkpoint's full form it is gathered per unit and cut back (``full_optimizer_state`` /
``sharded_optimizer_state``), so a checkpoint of a sharded run is the one a single process would write.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ringtrain.comm.shards import tensor_shards

__all__ = ["FlatUnit", "Run", "shard_optimizer", "full_optimizer_state", "sharded_optimizer_state"]


@dataclass
class Run:
    """A stretch ``[start, end)`` of a unit's flat coordinates inside this rank's shard, in one param group."""

    start: int
    end: int
    group: int
    param: nn.Parameter
    """What the optimizer steps: a view of this stretch of the rank's parameter shard."""


@dataclass
class FlatUnit:
    """Parameters reduced and gathered together as one flat tensor."""

    params: list[nn.Parameter]
    rank: int
    world_size: int
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    lo: int = 0
    hi: int = 0
    runs: list[Run] = field(default_factory=list)
    full: torch.Tensor | None = None
    """The flat parameters; the module's parameters are views of it (zero3: storage freed between uses)."""
    shard: torch.Tensor | None = None
    """zero3: this rank's parameter shard, kept while ``full`` is freed."""
    grad_full: torch.Tensor | None = None
    """zero1: the flat gradient the module's ``.grad`` views accumulate into."""
    grad_shard: torch.Tensor | None = None
    """This rank's gradient shard, accumulated over the step's micro-batches (zero2, zero3)."""
    ready: list[bool] = field(default_factory=list)

    def __post_init__(self):
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        probe = torch.empty(0, dtype=self.dtype)
        self.lo, self.hi = tensor_shards(probe.new_empty(self.numel), self.world_size)[self.rank]
        self.ready = [False] * len(self.params)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def flatten(self) -> torch.Tensor:
        """The parameters' values, end to end."""
        return torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else torch.empty(0)

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of its stretch of ``flat`` (same values, no copy later)."""
        for p, offset in zip(self.params, self.offsets):
            p.data = flat[offset : offset + p.numel()].view_as(p)

    def gather_grads(self, into: torch.Tensor) -> None:
        """Every parameter's gradient into its stretch of ``into`` (zero where there is none), then dropped."""
        for p, offset in zip(self.params, self.offsets):
            stretch = into[offset : offset + p.numel()]
            if p.grad is None:
                stretch.zero_()
            else:
                if p.grad.is_sparse:
                    raise TypeError(f"the zero strategies need dense gradients; {tuple(p.shape)} has a sparse one")
                stretch.copy_(p.grad.reshape(-1))
                p.grad = None

    def build_runs(self, group_of: dict[int, int], shard: torch.Tensor, shard_start: int) -> None:
        """The optimizer's parameters: views of ``shard`` (whose element 0 is flat position ``shard_start``),
        one per param group met inside [lo, hi); each unit has at least one (maybe empty) so that every rank
        holds the same optimizer structure."""
        self.runs = []
        segments: list[tuple[int, int, int]] = []
        for p, offset in zip(self.params, self.offsets):
            group = group_of[id(p)]
            if segments and segments[-1][2] == group and segments[-1][1] == offset:
                segments[-1] = (segments[-1][0], offset + p.numel(), group)
            else:
                segments.append((offset, offset + p.numel(), group))
        for start, end, group in segments:
            a, b = max(start, self.lo), min(end, self.hi)
            if a >= b and self.runs:
                continue
            a, b = (a, b) if a < b else (self.lo, self.lo)
            view = shard[a - shard_start : b - shard_start]
            self.runs.append(Run(a, b, group, nn.Parameter(view)))

    def set_run_grads(self, grad_shard: torch.Tensor, shard_start: int) -> None:
        for run in self.runs:
            run.param.grad = grad_shard[run.start - shard_start : run.end - shard_start]


def shard_optimizer(optimizer: torch.optim.Optimizer, units: list[FlatUnit],
                    shard_of: Callable[[FlatUnit], tuple[torch.Tensor, int]]) -> torch.optim.Optimizer:
    """The same optimizer class with the same param groups' hyperparameters, over the units' runs.

    ``shard_of(unit)`` gives the tensor holding the rank's parameter shard and the flat position of its first
    element. Every trainable parameter must be in the optimizer (its state is what is sharded)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    missing = [tuple(p.shape) for unit in units for p in unit.params if id(p) not in group_of]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameter(s) (shapes {missing[:3]}) are not in the optimizer; the zero "
            "strategies shard the optimizer over every trainable parameter: pass them all, or freeze the others"
        )
    if optimizer.state:
        raise ValueError("the optimizer already holds state; hand the zero strategy a fresh optimizer")
    for unit in units:
        unit.build_runs(group_of, *shard_of(unit))
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [r.param for u in units for r in u.runs if r.group == g]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return type(optimizer)(groups, **defaults)
    except TypeError as err:
        raise ValueError(f"cannot rebuild {type(optimizer).__name__} over the parameter shards ({err}); "
                         "use a torch.optim optimizer, or strategy 'ddp'") from None


def full_optimizer_state(optimizer: torch.optim.Optimizer, units: list[FlatUnit], param_ids: list[list[int]],
                         all_gather: Callable[[torch.Tensor], None]) -> dict[str, Any]:
    """torch's ``state_dict()`` form for the full model: state by index of the parameter in the original
    optimizer's groups (``param_ids``: their ``id()``s), every elementwise state gathered from the shards.
    A collective: every rank calls it, every rank gets the result."""
    where = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.params)}
    per_unit: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for u, unit in enumerate(units):
        keys = sorted({k for r in unit.runs for k, v in optimizer.state.get(r.param, {}).items()
                       if isinstance(v, torch.Tensor) and v.shape == r.param.shape})
        for key in keys:
            flat = torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device)
            for run in unit.runs:
                flat[run.start : run.end] = optimizer.state[run.param][key].reshape(-1)
            all_gather(flat)
            per_unit.setdefault(u, {})[key] = flat
        for run in unit.runs:
            for k, v in optimizer.state.get(run.param, {}).items():
                if k not in keys:
                    scalars.setdefault(u, {})[k] = v.clone() if isinstance(v, torch.Tensor) else v
    index_of_unit = {id(unit): u for u, unit in enumerate(units)}
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in param_ids:
        for pid in group:
            unit, i = where[pid]
            u = index_of_unit[id(unit)]
            if u in per_unit or u in scalars:
                lo = unit.offsets[i]
                shape = unit.params[i].shape
                entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.get(u, {}).items()}
                entry.update({k: flat[lo : lo + shape.numel()].view(shape).clone() for k, flat in per_unit.get(u, {}).items()})
                state[index] = entry
            index += 1
    groups, index = [], 0
    for group, ids in zip(optimizer.param_groups, param_ids):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(index, index + len(ids)))})
        index += len(ids)
    return {"state": state, "param_groups": groups}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, units: list[FlatUnit], param_ids: list[list[int]],
                            full: dict[str, Any]) -> dict[str, Any]:
    """``full_optimizer_state``'s form cut to this rank's runs, as ``optimizer.load_state_dict`` takes it."""
    ids = [pid for group in param_ids for pid in group]
    if len(ids) != sum(len(g["params"]) for g in full["param_groups"]):
        raise ValueError(f"the optimizer state holds {sum(len(g['params']) for g in full['param_groups'])} "
                         f"parameters but this model has {len(ids)}")
    saved = {ids[int(i)]: entry for i, entry in full["state"].items()}
    state: dict[int, dict[str, Any]] = {}
    run_index = {id(p): n for n, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for unit in units:
        entries = [saved.get(id(p)) for p in unit.params]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise ValueError("the optimizer state covers only some parameters of a unit; resume with strategy 'ddp'")
        keys = [k for k in entries[0] if k != "step" and all(
            isinstance(e.get(k), torch.Tensor) and e[k].shape == p.shape for e, p in zip(entries, unit.params))]
        flats = {k: torch.cat([e[k].reshape(-1) for e in entries]) for k in keys}
        for run in unit.runs:
            # Copies: each run steps its own counters in place (Adam's step), never the caller's.
            entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries[0].items() if k not in keys}
            entry.update({k: flat[run.start : run.end].clone() for k, flat in flats.items()})
            state[run_index[id(run.param)]] = entry
    groups, index = [], 0
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
    return {"state": state, "param_groups": groups}
