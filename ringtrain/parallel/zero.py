"""ZeRO data parallelism on ringtrain's own collectives: optimizer state, gradients and parameters sharded.

    >>> strategy = ZeroStrategy(torch.device("cpu"), stage=2, algorithm="shm", bucket_mb=4)
    >>> model = strategy.wrap(model)                         # rank 0's weights everywhere, then sharded
    >>> optimizer = strategy.shard_optimizer(build_optimizer(...))   # the same optimizer over this rank's shard
    >>> loss_fn(model(x)).backward()                          # gradients reduce-scattered during backward
    >>> optimizer.step()                                       # steps the shard, then parameters are gathered

For N workers and AdamW in fp32 (4 bytes of parameters, 4 of gradient, 8 of moments per parameter):

- ``stage=1`` (zero1): optimizer state sharded. Gradients accumulate locally in flat buckets (``no_sync``
  skips communication, as DDP's does); on the synchronising backward each bucket is reduce-scattered as soon as
  it is complete, each rank steps its shard, and an all-gather per bucket brings every rank the new
  parameters. 4 + 4 + 8/N bytes per parameter.
- ``stage=2`` (zero2): gradients sharded too. On *every* backward (``no_sync`` changes nothing) each bucket's
  gradients are copied into a staging buffer the moment the bucket is complete, reduce-scattered, added into
  the rank's gradient shard, and freed: the full gradient never outlives its bucket. 4 + 12/N, plus the
  staging buffers alive at once (one or two buckets).
- ``stage=3`` (zero3): parameters sharded too. One unit per block of the model (``units.block_units``) plus
  the root unit (everything else, tied embeddings included). A unit's parameters are all-gathered into a
  flat buffer just before its forward and freed after it; before its backward (the first gradient of its
  outputs) they are gathered again, and once its gradients are complete they are reduce-scattered and freed.
  The root unit stays gathered from the forward's start to its backward's end. 16/N, plus the gathered units
  (the root and one block at a time) and one unit's gradient staging.

Collectives run in the hooks, in one fixed order on every rank (units reduce strictly in their order, as
the manual strategy's buckets do), with ``[comm] algorithm`` (``ringtrain.comm.reduce_scatter`` /
``all_gather``, which share one shard cut); their time is booked as communication by the ``CommTimer``.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.errors import ConfigError
from ringtrain.comm.groups import group_rank, resolve_group
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy, optimizer_tensors, unique_storage_bytes
from ringtrain.parallel.buckets import broadcast_from_rank0, bucket_parameters, live_group
from ringtrain.parallel.comm_queue import CommQueue
from ringtrain.parallel.units import block_units
from ringtrain.parallel.zero_gather import Gatherer
from ringtrain.parallel.zero_flat import FlatUnit, full_optimizer_state, shard_optimizer, sharded_optimizer_state
from ringtrain.parallel.zero_state import materialize_optimizer_state, settle_empty_runs, zero_checkpoint_state

__all__ = ["from_config", "ZeroStrategy", "ZeroDataParallel"]


class ZeroDataParallel(nn.Module):
    """The model wrapped by ``ZeroStrategy``: forward is the module's, backward reduce-scatters gradients."""

    def __init__(self, module: nn.Module, stage: int, bucket_mb: float = 4.0, algorithm: str = "torch",
                 chunk_kb: int | None = None, group: dist.ProcessGroup | None = None,
                 comm_timer: CommTimer | None = None, prefetch: bool = True):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        if algorithm not in comm.ALGORITHMS:
            raise ValueError(f"the zero strategies communicate with one of {', '.join(comm.ALGORITHMS)}, not {algorithm!r}")
        self.module = module
        self.stage = stage
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb if algorithm == "ring_chunked" else None
        group = resolve_group(group)
        self._group = weakref.ref(group)  # never keep a destroyed group alive (see manual.py)
        self.world_size = dist.get_world_size(group)
        self.rank = group_rank(group)
        self.comm_timer = comm_timer or CommTimer()
        self.require_backward_grad_sync = True
        self.comm_calls = 0
        """Collectives issued so far (reduce-scatters and all-gathers)."""
        self._live_bytes = 0
        self.step_comm_s = 0.0
        """Seconds of all-gathers after optimizer steps, not yet booked (``ZeroStrategy.take_step_comm_s``)."""
        self.peak_buffer_bytes = 0
        """Most bytes of transient buffers (gradient staging, gathered units) held at once so far."""
        self._queue = CommQueue(self.comm_timer) if stage == 3 and prefetch and self.world_size > 1 else None
        """zero3 with prefetch: every collective of the passes runs on this thread, in hand-over order."""
        self._reducing: tuple[Future, int] | None = None
        """zero3 with prefetch: the reduce-scatter in flight and its staging bytes (one at a time)."""
        self._broadcast([p.data for p in module.parameters()] + list(module.buffers()))
        self._sync_buffers_next = True
        self._zero_grads_next = False
        trainable = [p for p in module.parameters() if p.requires_grad]
        if stage == 3:
            blocks = block_units(module)
            self._blocks = [FlatUnit([p for p in b.parameters() if p.requires_grad], self.rank, self.world_size)
                            for b in blocks]
            in_blocks = {id(p) for unit in self._blocks for p in unit.params}
            root = [p for p in trainable if id(p) not in in_blocks]
            self._root = FlatUnit(root, self.rank, self.world_size) if root else None
            self.units = [u for u in [self._root, *self._blocks] if u is not None and u.params]
            self._order = [*reversed([u for u in self._blocks if u.params]), *([self._root] if self._root else [])]
            self._set_up_stage3(blocks)
        else:
            self.units = [FlatUnit(members, self.rank, self.world_size)
                          for members in bucket_parameters(trainable, int(bucket_mb * 2**20))]
            self._order = list(self.units)
            for unit in self.units:
                unit.full = unit.flatten()
                unit.point_params_at(unit.full)
                if stage == 1:
                    unit.grad_full = torch.zeros_like(unit.full)  # gradients accumulate here (.grad are views)
                    for p, offset in zip(unit.params, unit.offsets):
                        p.grad = unit.grad_full[offset : offset + p.numel()].view_as(p)
        self._where = {id(p): (unit, i) for unit in self.units for i, p in enumerate(unit.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for u in self.units for p in u.params]
        self._next = 0
        self._callback_queued = False

    @property
    def group(self) -> dist.ProcessGroup:
        return live_group(self._group)

    def forward(self, *args, **kwargs):
        if self._zero_grads_next:  # zero1: the last step's gradients are spent
            for unit in self.units:
                unit.grad_full.zero_()
            self._zero_grads_next = False
        if self._sync_buffers_next:
            self._broadcast(list(self.module.buffers()))
        output = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """zero1: backward passes inside accumulate locally. zero2/zero3 reduce every micro-batch anyway
        (their gradient is sharded), so for them this changes nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = self.stage > 1
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # --- set-up ---------------------------------------------------------------------------------------
    def _set_up_stage3(self, blocks: list[nn.Module]) -> None:
        for unit in self.units:
            unit.full = unit.flatten()
            unit.shard = unit.full[unit.lo : unit.hi].clone()  # the rank's own parameters, kept
            unit.point_params_at(unit.full)
            unit.full.untyped_storage().resize_(0)
        used = [(b, u) for b, u in zip(blocks, self._blocks) if u.params]
        self._gatherer = Gatherer(self._start_gather, self._queue, self._hold, [u for _, u in used])
        for index, (block, unit) in enumerate(used):
            following = used[index + 1][1] if index + 1 < len(used) else None  # prefetched during this one
            block.register_forward_pre_hook(
                lambda m, args, unit=unit, following=following: self._before_forward(unit, following))
            block.register_forward_hook(lambda m, args, out, unit=unit: self._after_forward(unit, out))
        self.module.register_forward_pre_hook(lambda m, args: self._before_module_forward())
        self.module.register_forward_hook(lambda m, args, out: self._after_module_forward())

    def _before_module_forward(self) -> None:
        self._gatherer.start_forward()
        if self._root is not None:
            self._gatherer.gather(self._root)  # kept from here to the end of its backward

    def _after_module_forward(self) -> None:
        self._gatherer.end_pass()
        if self._root is not None and not torch.is_grad_enabled():
            self._gatherer.free(self._root)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        broadcast_from_rank0(tensors, self.group)

    # --- zero3: parameters gathered around their use (zero_gather.py) ------------------------------------
    def _start_gather(self, unit: FlatUnit) -> Future | None:
        """All-gather ``unit.full`` (its own shard is in place): on the communication thread when prefetching
        (its future), else now."""
        call = lambda: comm.all_gather(unit.full, self.algorithm, self.group, chunk_kb=self.chunk_kb)  # noqa: E731
        if self._queue is None:
            self._collective(call)
            return None
        self.comm_calls += 1
        return self._queue.submit(call)

    def _before_forward(self, unit: FlatUnit, following: FlatUnit | None) -> None:
        if self._gatherer.in_backward:  # activation checkpointing's recompute: the block's backward is next
            self._gatherer.gather(unit)
            return
        self._gatherer.before_forward(unit, following, torch.is_grad_enabled())

    def _after_forward(self, unit: FlatUnit, output: Any) -> None:
        if self._gatherer.in_backward:  # the recompute's outputs: the parameters stay for the block's backward
            return
        self._gatherer.free(unit)
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors:
            # The first gradient of the block's outputs: its backward is next, and needs the parameters.
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._gatherer.before_backward(unit),
                                                          mode="any")

    # --- during backward ------------------------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return  # zero1's accumulation micro-step: the gradient stays local
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        unit, index = self._where[id(param)]
        unit.ready[index] = True
        # Strictly in unit order: every rank issues the same collectives in the same order.
        while self._next < len(self._order) and all(self._order[self._next].ready):
            self._reduce(self._order[self._next])
            self._next += 1

    def _reduce(self, unit: FlatUnit) -> None:
        """Reduce-scatter the unit's gradient into this rank's shard (averaged over ranks)."""
        if self.stage == 1:
            for p, offset in zip(unit.params, unit.offsets):
                view = unit.grad_full[offset : offset + p.numel()]
                if p.grad is None:
                    view.zero_()  # unused in this forward: contributes nothing
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)
            self._collective(lambda: comm.reduce_scatter(unit.grad_full, "avg", self.algorithm, self.group,
                                                         chunk_kb=self.chunk_kb))
            unit.set_run_grads(unit.grad_full[unit.lo : unit.hi], unit.lo)
            return
        self._wait_reduce()  # one unit's staging at a time
        staging = torch.empty(unit.numel, dtype=unit.dtype, device=unit.device)
        self._hold(unit.nbytes)
        unit.gather_grads(staging)
        if self.stage == 3:
            self._gatherer.free(unit)  # its backward is over (every gradient is in); a waiting prefetch starts
        reduce = lambda: comm.reduce_scatter(staging, "avg", self.algorithm, self.group, chunk_kb=self.chunk_kb)  # noqa: E731
        if self._queue is not None:  # on the communication thread, while the next unit's backward computes
            self.comm_calls += 1
            self._reducing = (self._queue.submit(lambda: _accumulate(unit, reduce())), unit.nbytes)
            return
        _accumulate(unit, self._collective(reduce))
        del staging
        self._hold(-unit.nbytes)

    def _wait_reduce(self) -> None:
        if self._reducing is not None:
            future, nbytes = self._reducing
            self._reducing = None
            self._queue.wait(future)
            self._hold(-nbytes)

    def _finish_backward(self) -> None:
        try:
            for unit in self._order[self._next :]:  # never complete: some parameters unused
                self._reduce(unit)
            if self.stage == 3:
                self._wait_reduce()
                self._gatherer.end_pass()
            if self.stage == 1:
                self._zero_grads_next = True
            self.comm_timer.syncs += 1
        finally:
            self._next = 0
            self._callback_queued = False
            for unit in self.units:
                unit.ready = [False] * len(unit.params)

    # --- after the optimizer step -----------------------------------------------------------------------
    def gather_parameters(self) -> None:
        """zero1/zero2: every rank's updated shard to every rank (an all-gather per bucket)."""
        if self.stage == 3:
            return
        called = time.perf_counter()
        with torch.no_grad():
            for unit in self.units:
                self.comm_calls += 1
                comm.all_gather(unit.full, self.algorithm, self.group, chunk_kb=self.chunk_kb)
        self.comm_timer.completed(called)
        self.step_comm_s += time.perf_counter() - called

    def _collective(self, call):
        self.comm_calls += 1
        called = time.perf_counter()
        result = call()
        self.comm_timer.launched(called)
        self.comm_timer.completed(called)
        return result

    def _hold(self, nbytes: int) -> None:
        self._live_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._live_bytes)

    def shard_of(self, unit: FlatUnit) -> tuple[torch.Tensor, int]:
        """The tensor holding this rank's parameter shard of ``unit``, and the flat position of its start."""
        if self.stage == 3:
            return unit.shard, unit.lo
        return unit.full, 0


class ZeroStrategy(ReplicatedStrategy):
    """ZeRO stage 1, 2 or 3 (``ZeroDataParallel``) as a strategy for the training loop."""

    gradients_replicated = False

    def __init__(self, device: torch.device, stage: int, bucket_mb: float = 4.0, algorithm: str = "torch",
                 chunk_kb: int | None = None, prefetch: bool = True, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        """The data-parallel ranks (None: every rank; beside tensor parallelism the dp sub-mesh's)."""
        self.prefetch = prefetch
        self.stage = stage
        self.name = f"zero{stage}"
        self.bucket_mb = bucket_mb
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb
        self.comm_timer = CommTimer()
        self.reduces_every_micro_batch = stage > 1
        self.forward_is_collective = stage == 3
        self.step_operation = ("all_gather and reduce_scatter (ZeRO-3 parameter units and gradient buckets)"
                               if stage == 3 else f"reduce_scatter (ZeRO-{stage} gradient buckets)")
        self._param_ids: list[list[int]] = []
        self._wrapped: ZeroDataParallel | None = None

    def wrap(self, model: nn.Module) -> ZeroDataParallel:
        model.to(self.device)
        self._wrapped = ZeroDataParallel(model, self.stage, self.bucket_mb, self.algorithm, self.chunk_kb,
                                         group=self.group, comm_timer=self.comm_timer, prefetch=self.prefetch)
        return self._wrapped

    def no_sync(self, model: ZeroDataParallel) -> AbstractContextManager:
        return model.no_sync()

    def unwrap(self, model: ZeroDataParallel) -> nn.Module:
        return model.module

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer over this rank's shards; after each of its steps, parameters are gathered."""
        wrapped = self._require_wrapped()
        self._param_ids = [[id(p) for p in group["params"]] for group in optimizer.param_groups]
        try:
            sharded = shard_optimizer(optimizer, wrapped.units, wrapped.shard_of)
        except ValueError as err:
            raise ConfigError(f"comm.strategy = '{self.name}': {err}") from None
        sharded.register_step_post_hook(lambda opt, args, kwargs: wrapped.gather_parameters())
        return sharded

    def take_step_comm_s(self) -> float:
        """Seconds the optimizer step spent gathering parameters since the last call (booked as communication)."""
        wrapped = self._require_wrapped()
        seconds, wrapped.step_comm_s = wrapped.step_comm_s, 0.0
        return seconds

    def gradient_parameters(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def clip_grad_norm_(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ with the norm summed over every rank's shard (one small all-reduce)."""
        grads = [g for g in (p.grad for p in self.gradient_parameters(model, optimizer)) if g is not None]
        squares = torch.stack([g.detach().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        total = squares.to(torch.float32).reshape(1)
        if model.world_size > 1:
            dist.all_reduce(total, group=model.group)
        norm = total.sqrt()[0]
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient)
        return norm

    @contextmanager
    def full_parameters(self, model: ZeroDataParallel) -> Iterator[nn.Module]:
        if self.stage < 3:
            yield model.module
            return
        # Into buffers of their own, not the hooks' (exporting one to numpy would pin its storage).
        views = {}
        with torch.no_grad():
            for unit in model.units:
                views[id(unit)] = [p.data for p in unit.params]
                flat = torch.empty(unit.numel, dtype=unit.dtype, device=unit.device)
                flat[unit.lo : unit.hi].copy_(unit.shard)
                comm.all_gather(flat, self.algorithm, model.group, chunk_kb=model.chunk_kb)
                unit.point_params_at(flat)
        try:
            yield model.module
        finally:
            for unit in model.units:
                for p, view in zip(unit.params, views[id(unit)]):
                    p.data = view

    def model_state_dict(self, model: ZeroDataParallel) -> dict[str, torch.Tensor]:
        with self.full_parameters(model) as module:
            return {k: v.clone() for k, v in module.state_dict().items()}

    def load_model_state_dict(self, model: ZeroDataParallel, state: dict[str, torch.Tensor]) -> None:
        with self.full_parameters(model) as module:
            module.load_state_dict(state)
            if self.stage == 3:
                with torch.no_grad():
                    for unit in model.units:
                        unit.shard.copy_(unit.flatten()[unit.lo : unit.hi])

    def checkpoint_state(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's stretches of every parameter and elementwise optimizer state, as DCP chunks with global
        offsets (``zero_state``), with no communication: each rank writes only what it owns."""
        return zero_checkpoint_state(model.module, optimizer, model.units, model.shard_of, full_model=False)

    def load_checkpoint_state(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer,
                              load: Callable[[dict[str, Any]], None]) -> None:
        """Read a sharded checkpoint (any layout: zero at any world size, ddp, fsdp) into this rank's shards
        and optimizer state in place. zero1/2 read whole parameters (every rank holds them all)."""
        materialize_optimizer_state(optimizer)
        load(zero_checkpoint_state(model.module, optimizer, model.units, model.shard_of, full_model=self.stage < 3))
        settle_empty_runs(optimizer, model.units)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model = self._require_wrapped()
        return full_optimizer_state(optimizer, model.units, self._param_ids,
                                    lambda flat: comm.all_gather(flat, self.algorithm, model.group, chunk_kb=model.chunk_kb))

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return sharded_optimizer_state(optimizer, self._require_wrapped().units, self._param_ids, state)

    def state_tensors(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        for unit in model.units:
            yield from (t for t in (getattr(unit, "full", None), getattr(unit, "shard", None),
                                    getattr(unit, "grad_full", None), unit.grad_shard) if t is not None)
        yield from model.module.parameters()
        yield from (p.grad for p in model.module.parameters() if p.grad is not None)
        yield from optimizer_tensors(optimizer)

    def model_state_bytes(self, model: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> int:
        """Persistent storage (parameters, shards, gradients, optimizer state) plus the most bytes of transient
        buffers (gradient staging, gathered units) held at once."""
        return unique_storage_bytes(self.state_tensors(model, optimizer)) + model.peak_buffer_bytes

    def close(self) -> None:
        """Let zero3's communication thread end (a trainer built again by a heal, or one that finished; its
        executor would otherwise live as long as the trainer does, and a finished worker joins it)."""
        queue = getattr(self._wrapped, "_queue", None)
        if queue is not None:
            queue.close()

    def _require_wrapped(self) -> ZeroDataParallel:
        if self._wrapped is None:
            raise RuntimeError("wrap the model before sharding its optimizer")
        return self._wrapped


def _accumulate(unit: FlatUnit, shard: torch.Tensor) -> None:
    """Add a reduce-scattered gradient shard into the unit's (a fresh one after the optimizer zeroed it)."""
    if unit.grad_shard is None or unit.runs[0].param.grad is None:
        unit.grad_shard = shard.clone()
        unit.set_run_grads(unit.grad_shard, unit.lo)
    else:
        unit.grad_shard.add_(shard)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [t for t in (getattr(value, "logits", None),) if isinstance(t, torch.Tensor)]


def from_config(comm, device: torch.device, *, spec, diloco=None, heal: bool = False, mesh=None) -> ZeroStrategy:
    """``comm.strategy = 'zero1' | 'zero2' | 'zero3'`` (the registry's builder; the stage is the spec's) over the
    1-D ``mesh``'s ranks (beside tensor parallelism: the data-parallel sub-mesh), or every rank."""
    return ZeroStrategy(device, stage=spec.options["stage"], bucket_mb=comm.resolved_bucket_mb,
                        algorithm=comm.algorithm, chunk_kb=comm.chunk_kb, prefetch=comm.prefetch,
                        group=None if mesh is None else mesh.get_group())
