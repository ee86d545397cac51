"""The zero strategies' sharded checkpoint form: each rank's own stretch of every parameter and of every
elementwise optimizer state, as chunks with global offsets that ``torch.distributed.checkpoint`` (DCP) writes
and reshards, with no communication.

A rank's stretch ``[a, b)`` of a parameter's flattened elements (``FlatUnit``'s cut) is, in the parameter's
own shape, a few boxes: a part of a row, whole rows, a part of a row (recursively in more dimensions; at most
``2 * ndim - 1``), each contiguous in memory, so each is a view of the rank's flat shard. They become the
local shards of a ``ShardedTensor`` whose global metadata lists every rank's boxes (every rank computes them
from the same cut). DCP matches chunks by rectangle overlap, so what one layout saved loads into any other:
another number of zero ranks, another stage, DDP's full tensors, FSDP2's dim-0 DTensor shards, and back.
This is how torchrec's row-wise shards reach DCP; FSDP1 instead all-gathered its flat parameters and cut
them again on dim 0 to save (a collective and a full unit in memory per save).

Keys are those of torch's ``get_state_dict``, so the replicated strategies and FSDP2 read and write the
same checkpoint: ``model.<state_dict name>`` (tied weights under each of their names) and
``optimizer.state.<first parameter name>.<key>``. A parameter whose every element one rank owns is a plain
tensor there (DCP stores a plain tensor once); non-elementwise state (Adam's ``step``) is a plain tensor of
every rank that owns some of the parameter, equal on all of them.

    state = zero_checkpoint_state(module, optimizer, units, shard_of, rank, world_size, full_model=False)
    dcp.save(state, ...)            # each rank its stretches
    dcp.load(state, ...)            # in place into the shards (and the optimizer's state), resharded
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from ringtrain.comm.shards import ALIGN_BYTES, shard_bounds
from ringtrain.parallel.zero_flat import FlatUnit

__all__ = ["flat_boxes", "zero_checkpoint_state", "materialize_optimizer_state", "settle_empty_runs"]

# torch marks ShardedTensor deprecated in favour of DTensor, but a DTensor's shard is one dim-0 (or grid)
# block and cannot be a row-major stretch; DCP still reads and writes ShardedTensor (torchrec's form). Its
# notice would fire on every attribute DCP reads, from the background writer's thread too: silenced for
# this one message, process-wide.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""(offsets, sizes, position of the box's first element in the stretch)."""


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of a tensor of ``shape`` in row-major order, as boxes in that shape, in order.

    >>> flat_boxes((5, 7), 16, 35)     # the rest of row 2, then rows 3 and 4
    [((2, 2), (1, 5), 0), ((3, 0), (2, 7), 5)]
    """
    boxes: list[Box] = []

    def cut(prefix: tuple[int, ...], dims: tuple[int, ...], a: int, b: int, at: int) -> None:
        if a >= b:
            return
        if not dims:
            boxes.append((prefix, (1,) * len(prefix), at))
            return
        inner = 1
        for d in dims[1:]:
            inner *= d
        row_a, row_b = a // inner, b // inner
        if a % inner:  # a part of row_a first
            stop = min(b, (row_a + 1) * inner)
            cut(prefix + (row_a,), dims[1:], a - row_a * inner, stop - row_a * inner, at)
            at, a, row_a = at + stop - a, stop, row_a + 1
        if row_a < row_b:  # whole rows
            boxes.append((prefix + (row_a,) + (0,) * (len(dims) - 1), (1,) * len(prefix) + (row_b - row_a, *dims[1:]), at))
            at, a = at + (row_b - row_a) * inner, row_b * inner
        if a < b:  # a part of row_b last
            cut(prefix + (row_b,), dims[1:], a - row_b * inner, b - row_b * inner, at)

    cut((), tuple(shape), start, end, 0)
    return boxes


def _sharded(values: torch.Tensor, shape: torch.Size, stretches: list[tuple[int, int]], rank: int,
             global_ranks: list[int] | None = None) -> torch.Tensor:
    """``values`` (this rank's stretch, flat) as DCP sees it: a plain view when it is the whole tensor, else a
    ShardedTensor of its boxes with every rank's boxes in the global metadata."""
    a, b = stretches[rank]
    if (a, b) == (0, shape.numel()):
        return values.view(shape)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = values.device if values.device.type == "cpu" else torch.device(values.device.type, values.device.index or 0)
    every, local = [], []
    for r, (lo, hi) in enumerate(stretches):
        for offsets, sizes, at in flat_boxes(tuple(shape), lo, hi):
            meta = ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=f"rank:{r if global_ranks is None else global_ranks[r]}/{device}")
            every.append(meta)
            if r == rank:
                local.append(Shard(values[at : at + _numel(sizes)].view(sizes), meta))
    properties = TensorProperties(dtype=values.dtype, requires_grad=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(every, shape, properties))


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _stretches(unit: FlatUnit, offset: int, numel: int) -> list[tuple[int, int]]:
    """Every rank's stretch of the parameter at ``offset`` of ``unit``, in the parameter's own positions."""
    align = max(1, ALIGN_BYTES // unit.params[0].element_size())
    out = []
    for lo, hi in shard_bounds(unit.numel, unit.world_size, align):
        a, b = max(offset, lo), min(offset + numel, hi)
        out.append((a - offset, b - offset) if a < b else (0, 0))
    return out


def zero_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer, units: list[FlatUnit],
                          shard_of: Callable[[FlatUnit], tuple[torch.Tensor, int]], full_model: bool,
                          global_ranks: list[int] | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": {"state": ...}}`` over this rank's own tensors (views: DCP writes from
    them and loads into them). ``full_model``: the module's parameters are full on every rank (zero1/2) and are
    loaded whole; otherwise (and always for saving) each rank has its stretches only. ``global_ranks``: the
    job's rank of each rank of the units' group, when it is not the whole job (the ranks beside a pipeline
    stage); DCP places chunks by the job's ranks."""
    where = {id(p): (unit, offset) for unit in units for p, offset in zip(unit.params, unit.offsets)}
    rank = units[0].rank if units else 0
    model: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        found = where.get(id(tensor))
        if found is None or full_model:  # buffers, frozen parameters; or zero1/2 loading whole parameters
            model[name] = tensor.detach()
            continue
        unit, offset = found
        stretches = _stretches(unit, offset, tensor.numel())
        a, b = stretches[rank]
        if a < b:
            shard, shard_start = shard_of(unit)
            model[name] = _sharded(shard[offset + a - shard_start : offset + b - shard_start].detach(),
                                   tensor.shape, stretches, rank, global_ranks)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in module.named_parameters():
        found = where.get(id(p))
        if found is None:
            continue
        unit, offset = found
        stretches = _stretches(unit, offset, p.numel())
        a, b = stretches[rank]
        if a >= b:
            continue
        run = next(r for r in unit.runs if r.start <= offset + a and offset + b <= r.end)
        entry = {}
        for key, value in optimizer.state.get(run.param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue  # kept out of DCP (see checkpoint/sharded.py): follows the config on resume
            if key != "step" and value.shape == run.param.shape:
                stretch = value[offset + a - run.start : offset + b - run.start]
                entry[key] = _sharded(stretch, p.shape, stretches, rank, global_ranks)
            else:
                entry[key] = value
        if entry:
            state[name] = entry
    return {"model": model, "optimizer": {"state": state}}


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (Adam's moments are made by its first step) so that a checkpoint can be
    loaded into it: torch's way, a step with zero gradients and lr 0 (what ``set_state_dict`` does)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def settle_empty_runs(optimizer: torch.optim.Optimizer, units: list[FlatUnit]) -> None:
    """A run with no elements (the rank owns none of a unit) reads nothing from a checkpoint: give it the
    non-elementwise state (``step``) of a run that did, so every run agrees."""
    runs = [r for u in units for r in u.runs]
    source = next((optimizer.state[r.param] for r in runs if r.end > r.start and r.param in optimizer.state), None)
    if source is None:
        return
    for run in runs:
        if run.end == run.start and run.param in optimizer.state:
            for key, value in source.items():
                if isinstance(value, torch.Tensor) and (key == "step" or value.shape != run.param.shape):
                    optimizer.state[run.param][key] = value.clone()
