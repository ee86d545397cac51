"""ZeRO beside a pipeline: each of a pipeline rank's stages wrapped by the registry's zero strategy
(``zero.ZeroDataParallel``) over the layout's ``dp`` ranks, the ranks holding the same stages.

    stages = StageZero(zero_strategy, dp_group)          # zero_strategy: strategy_spec("zero2").build(...)
    wrapped = stages.wrap(pipeline.modules)              # one ZeroDataParallel per stage (the schedule runs them)
    optimizer = stages.shard_optimizer(optimizer)        # the stages' optimizer over this rank's shards

The schedule runs every micro-batch's backward through the wrapper's hooks: zero2 and zero3 reduce-scatter each
micro-batch's gradients (as under accumulation), zero1 only the stage's last backward (the schedule's
``last_backward``, what torch's stages give DDP's ``no_sync``). The gradient scale is the pipeline's: each
micro-batch's loss carries the data-parallel size over the step's items, the reduce-scatter averages.

The tied embedding of the built-in transformer lives on the first stage and, as a copy, on the last, each in a
flat unit of its own stage laid out differently: the two ranks' gradient shards hold different stretches of it.
So the tie is summed on the whole gradient: each rank's stretch put in place and summed over dp (the stretches
are disjoint), added over the tie group, and each rank's stretch taken back (``sum_tied``).

zero3's units are gathered for the whole schedule (every micro-batch's forward and backward; torch's pipelined
FSDP keeps its parameters unsharded between a stage's backwards too) and freed after the stage's last backward:
parameters are sharded between steps, gradients at every micro-batch, optimizer state always.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.parallel.zero import ZeroDataParallel, ZeroStrategy
from ringtrain.parallel.zero_flat import FlatUnit, full_optimizer_state, shard_optimizer, sharded_optimizer_state
from ringtrain.parallel.zero_state import materialize_optimizer_state, settle_empty_runs, zero_checkpoint_state

__all__ = ["StageZero"]


class StageZero:
    """The zero wrappers of one pipeline rank's stages, and what the pipeline asks of them."""

    def __init__(self, zero: ZeroStrategy, group: dist.ProcessGroup):
        self.zero, self.group = zero, group
        self.stage = zero.stage
        self.wrappers: list[ZeroDataParallel] = []
        self._params: list[list[nn.Parameter]] = []
        """The optimizer's groups before sharding (this rank's parameters): the full forms' order."""

    def wrap(self, modules: list[nn.Module]) -> list[ZeroDataParallel]:
        # zero3 without prefetch: its units are gathered once for the whole schedule (the module docstring).
        self.wrappers = [ZeroDataParallel(module, self.stage, self.zero.bucket_mb, self.zero.algorithm,
                                          self.zero.chunk_kb, group=self.group, comm_timer=self.zero.comm_timer,
                                          prefetch=False) for module in modules]
        if self.stage == 3:
            for wrapper in self.wrappers:
                _gather_for_the_step(wrapper)
        return self.wrappers

    @property
    def units(self) -> list[FlatUnit]:
        return [unit for wrapper in self.wrappers for unit in wrapper.units]

    def before_backward(self, wrapper: ZeroDataParallel, last_backward: bool) -> None:
        """zero1 reduces on the stage's last backward of the step only (the others accumulate locally)."""
        wrapper.require_backward_grad_sync = last_backward or self.stage > 1

    def after_backward(self, wrapper: ZeroDataParallel, last_backward: bool) -> None:
        """zero3: the stage's parameters freed after its last backward of the step."""
        if self.stage == 3 and last_backward:
            wrapper.release()

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """zero3: every stage's parameters gathered while the full forms are read or written; a write is copied
        into this rank's shards before they are freed."""
        if self.stage < 3:
            yield
            return
        for wrapper in self.wrappers:
            wrapper.gather_all()
        try:
            yield
        finally:
            with torch.no_grad():
                for unit in self.units:
                    unit.shard.copy_(unit.full[unit.lo : unit.hi])
            for wrapper in self.wrappers:
                wrapper.release()

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._params = [list(group["params"]) for group in optimizer.param_groups]
        sharded = shard_optimizer(optimizer, self.units, self.wrappers[0].shard_of)
        sharded.register_step_post_hook(lambda opt, args, kwargs: self._after_step())
        return sharded

    def _after_step(self) -> None:
        for wrapper in self.wrappers:
            wrapper.gather_parameters()

    def take_step_comm_s(self) -> float:
        seconds = sum(wrapper.step_comm_s for wrapper in self.wrappers)
        for wrapper in self.wrappers:
            wrapper.step_comm_s = 0.0
        return seconds

    # --- the step's gradients ---------------------------------------------------------------------------
    def _piece(self, param: nn.Parameter) -> tuple[torch.Tensor, int, int] | None:
        """This rank's stretch of ``param``'s reduced gradient: a view of its unit's gradient shard, and where it
        sits in the parameter's flat elements; None when this rank's shard holds none of it."""
        for wrapper in self.wrappers:
            if id(param) in wrapper._where:
                unit, index = wrapper._where[id(param)]
                shard = _grad_shard(unit)
                start = unit.offsets[index]
                a, b = max(start, unit.lo), min(start + param.numel(), unit.hi)
                if a >= b or shard is None:
                    return None
                return shard[a - unit.lo : b - unit.lo], a - start, b - start
        raise KeyError("a parameter no stage of this rank holds")

    def sum_tied(self, param: nn.Parameter, tie_group: dist.ProcessGroup) -> None:
        """The tied weight's reduced gradient added over the tie group (the module docstring)."""
        whole = torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
        piece = self._piece(param)
        if piece is not None:
            whole[piece[1] : piece[2]] = piece[0]
        dist.all_reduce(whole, group=self.group)  # the dp ranks' disjoint stretches: the stage's whole gradient
        dist.all_reduce(whole, group=tie_group)
        if piece is not None:
            piece[0].copy_(whole[piece[1] : piece[2]])

    def squares(self, uncounted: nn.Parameter | None) -> torch.Tensor:
        """The squares of this rank's gradient shards, ``uncounted``'s stretch left out (the tied copy)."""
        squares = torch.zeros((), dtype=torch.float64)
        for unit in self.units:
            shard = _grad_shard(unit)
            if shard is not None:
                squares += shard.detach().double().pow(2).sum()
        piece = self._piece(uncounted) if uncounted is not None else None
        if piece is not None:
            squares -= piece[0].detach().double().pow(2).sum()
        return squares

    def scale(self, coefficient: torch.Tensor) -> None:
        for unit in self.units:
            shard = _grad_shard(unit)
            if shard is not None:
                shard.mul_(coefficient.to(shard.dtype))

    def gradient_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    # --- full forms ---------------------------------------------------------------------------------------
    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[nn.Parameter]]:
        """torch's ``state_dict()`` form of the unsharded optimizer over this rank's parameters (gathered over
        dp), and those parameters in its order."""
        ids = [[id(p) for p in group] for group in self._params]
        gather = lambda flat: comm.all_gather(flat, self.zero.algorithm, self.group, chunk_kb=self.zero.chunk_kb)  # noqa: E731
        return full_optimizer_state(optimizer, self.units, ids, gather), [p for g in self._params for p in g]

    def param_groups(self) -> list[list[nn.Parameter]]:
        return self._params

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, local: dict[str, Any]) -> dict[str, Any]:
        """``full_optimizer_state``'s form cut to this rank's runs."""
        return sharded_optimizer_state(optimizer, self.units, [[id(p) for p in group] for group in self._params], local)

    # --- sharded checkpoints -------------------------------------------------------------------------------
    def checkpoint_state(self, view: nn.Module, optimizer: torch.optim.Optimizer, copy: str | None) -> dict[str, Any]:
        """zero's DCP form (``zero_state``: each rank's stretches with global offsets) of the stages in ``view``
        (named as the whole model). ``copy``: the name of the last stage's copy of the tied weight, whose optimizer
        entry is left out: the first stage writes the weight's (equal, but cut by another unit's stretches)."""
        state = zero_checkpoint_state(view, optimizer, self.units, self.wrappers[0].shard_of, full_model=False,
                                       global_ranks=self._global_ranks())
        if copy is not None:
            state["optimizer"]["state"].pop(copy, None)
        return state

    def load_checkpoint_state(self, view: nn.Module, optimizer: torch.optim.Optimizer, load: Any,
                              copy: str | None, tied: str) -> None:
        """Read a sharded checkpoint into this rank's shards and optimizer state in place (the copy's optimizer
        state from the tied weight's entry); zero1/2 read whole parameters."""
        materialize_optimizer_state(optimizer)
        state = zero_checkpoint_state(view, optimizer, self.units, self.wrappers[0].shard_of,
                                      full_model=self.stage < 3, global_ranks=self._global_ranks())
        if copy is not None and copy in state["optimizer"]["state"]:
            state["optimizer"]["state"][tied] = state["optimizer"]["state"].pop(copy)
        load(state)
        settle_empty_runs(optimizer, self.units)

    def _global_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def state_tensors(self) -> Iterable[torch.Tensor]:
        for unit in self.units:
            yield from (t for t in (unit.full, unit.shard, unit.grad_full, unit.grad_shard) if t is not None)

    @property
    def peak_buffer_bytes(self) -> int:
        return sum(wrapper.peak_buffer_bytes for wrapper in self.wrappers)


def _grad_shard(unit: FlatUnit) -> torch.Tensor | None:
    """The unit's reduced gradient shard (zero1: its stretch of the flat gradient, reduced in place)."""
    return unit.grad_full[unit.lo : unit.hi] if unit.grad_full is not None else unit.grad_shard


def _gather_for_the_step(wrapper: ZeroDataParallel) -> None:
    """zero3 inside a pipeline stage: every unit gathered at the stage's first forward of a step and kept through
    every micro-batch's backward (the schedule runs several forwards before the first backward), freed after the
    stage's last backward (``release``), or after a forward without gradients (evaluation); each micro-batch's
    gradients are reduce-scattered as they complete. zero3's own per-block gather and free hooks are removed."""
    gatherer = wrapper._gatherer
    for module in wrapper.module.modules():
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
    free = gatherer.free
    kept = {"on": False}

    def gather_all() -> None:
        if not kept["on"]:
            kept["on"] = True
            for unit in wrapper.units:
                gatherer.gather(unit)

    def release() -> None:
        kept["on"] = False
        for unit in wrapper.units:
            free(unit)

    gatherer.free = lambda unit: None if kept["on"] else free(unit)  # a unit's reduce frees it: not yet
    wrapper.module.register_forward_pre_hook(lambda module, args: gather_all())
    wrapper.module.register_forward_hook(lambda module, args, out: None if torch.is_grad_enabled() else release())
    wrapper.gather_all, wrapper.release = gather_all, release
