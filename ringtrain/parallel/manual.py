"""ringtrain's own gradient synchronisation: buckets all-reduced during backward, as soon as they are full.

    >>> strategy = ManualStrategy(torch.device("cpu"), bucket_mb=25, algorithm="shm")
    >>> model = strategy.wrap(model)           # rank 0's weights everywhere; a hook on every parameter
    >>> with strategy.no_sync(model):           # accumulation micro-step: no communication at all
    ...     loss_fn(model(x0)).backward()
    >>> loss_fn(model(x1)).backward()           # each bucket all-reduced as soon as its gradients exist
    >>> optimizer.step()                        # .grad is the average over all workers

How it works, in the order things happen:

- ``wrap``: parameters that need gradients are grouped into buckets of at most ``bucket_mb`` (per dtype), in
  reverse registration order, the order backward usually produces their gradients (DDP's heuristic). A
  bucket is one flat tensor; after its first all-reduce each parameter's ``.grad`` is a view of its slice,
  so the reduced bucket *is* the gradient, with nothing copied back. With ``algorithm="shm"`` buckets live
  in shared memory, where peers read them in place: no copy into a workspace either.
- during backward, a post-accumulate-grad hook on each parameter marks it ready; a full bucket is
  all-reduced (``op="avg"``: divided by the world size, then summed) at once, while backward goes on
  computing the earlier layers' gradients. Buckets go strictly in bucket order, so every rank issues the
  same collectives in the same order even when its backward finishes them in another. ``torch`` runs
  asynchronously (Gloo/NCCL progress it on their own threads); ``ring``, ``ring_chunked`` and ``shm`` run in
  the hook.
- at the end of backward (autograd's ``queue_callback``, as DDP does) buckets that never filled (parameters
  unused in this forward; their gradient counts as zero) are reduced, and every pending all-reduce is
  waited on: when ``backward()`` returns, gradients are synchronised and the optimizer needs nothing else.
- inside ``no_sync`` the hooks do nothing: gradients accumulate locally and the next synchronised backward
  reduces the accumulated sum, so there is exactly one all-reduce per bucket per optimizer step.
- buffers (BatchNorm statistics) are broadcast from rank 0 before the first forward after a synchronised
  one, as DDP does.
- ``release()`` (or ``ManualStrategy.unwrap(model, release=True)``, or wrapping the same module again) ends
  the wrapping: hooks off, gradients copied out of the buckets, the buckets and their shared memory freed.
  The process group is held weakly: a wrapped model kept past ``destroy_process_group()`` (a module-level
  variable) must not keep the group's Gloo threads alive into interpreter shutdown, where they abort it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.comm.groups import resolve_group
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.parallel.buckets import broadcast_from_rank0, bucket_parameters, live_group

__all__ = ["from_config", "ManualStrategy", "BucketedDataParallel"]

_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""module -> weakref to the BucketedDataParallel whose hooks are on its parameters (one at a time)."""


@dataclass
class _Bucket:
    """Parameters whose gradients are reduced together, and the flat tensor they are reduced in."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's slice of ``flat``, shaped like the parameter."""
    ready: list[bool] = field(default_factory=list)


class BucketedDataParallel(nn.Module):
    """The model wrapped by ``ManualStrategy``: forward is the module's; backward synchronises gradients."""

    def __init__(
        self,
        module: nn.Module,
        bucket_mb: float = 25.0,
        algorithm: str = "torch",
        chunk_kb: int | None = None,
        group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        comm_timer: CommTimer | None = None,
    ):
        super().__init__()
        if algorithm not in comm.ALGORITHMS:
            raise ValueError(f"the manual strategy reduces with one of {', '.join(comm.ALGORITHMS)}, not {algorithm!r}")
        previous = _OWNERS.get(module)
        if previous is not None and previous() is not None:
            # Wrapped again: its hooks would reduce every bucket twice, and its buckets would stay mapped.
            previous().release()
        self.module = module
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb if algorithm == "ring_chunked" else None
        group = resolve_group(group)
        self._group = weakref.ref(group)  # never keep a destroyed group (and its Gloo threads) alive
        self.world_size = dist.get_world_size(group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.comm_calls = 0
        """All-reduces issued so far (one per bucket per synchronised backward)."""
        self.comm_timer = comm_timer or CommTimer()
        self._sync_buffers_next = True
        self._broadcast_state()
        self._buckets = self._build_buckets(int(bucket_mb * 2**20))
        self._where = {p: (bucket, i) for bucket in self._buckets for i, p in enumerate(bucket.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._where]
        self._next_bucket = 0
        self._pending: list[dist.Work] = []
        self._callback_queued = False
        _OWNERS[module] = weakref.ref(self)

    @property
    def group(self) -> dist.ProcessGroup:
        return live_group(self._group)

    def forward(self, *args, **kwargs):
        # DDP's rule: buffers follow rank 0 before the first forward after a synchronised one.
        if self._sync_buffers_next and self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))
        output = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def release(self) -> None:
        """End the wrapping: backward no longer synchronises, gradients become tensors of their own, and the
        buckets (with their shared memory, for ``shm``) are freed. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for bucket in self._buckets:
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None and param.grad.data_ptr() == view.data_ptr():
                    param.grad = view.clone()  # a view would keep the whole bucket mapped
        self._buckets, self._where, self._pending = [], {}, []
        if _OWNERS.get(self.module) is not None and _OWNERS[self.module]() is self:
            del _OWNERS[self.module]

    # --- set-up ---------------------------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        # Every rank starts from rank 0's weights, as DDP guarantees.
        with torch.no_grad():
            self._broadcast([p.data for p in self.module.parameters()] + list(self.module.buffers()))

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        broadcast_from_rank0(tensors, self.group)

    def _build_buckets(self, bucket_bytes: int) -> list[_Bucket]:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        return [self._allocate(params) for params in bucket_parameters(trainable, bucket_bytes)]

    def _allocate(self, params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        dtype, device = params[0].dtype, params[0].device
        if self.algorithm == "shm":
            flat = shm.shared_empty(numel, dtype, self.group)  # peers reduce it in place: no staging copies
            flat.zero_()
        else:
            flat = torch.zeros(numel, dtype=dtype, device=device)
        bucket = _Bucket(params, flat, ready=[False] * len(params))
        offset = 0
        for p in params:
            bucket.views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return bucket

    # --- during backward ------------------------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return  # accumulation micro-step: the gradient stays local
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, index = self._where[param]
        bucket.ready[index] = True
        # Only in bucket order: every rank must issue the same collectives in the same order.
        while self._next_bucket < len(self._buckets) and all(self._buckets[self._next_bucket].ready):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        for param, view in zip(bucket.params, bucket.views):
            grad = param.grad
            if grad is None:
                view.zero_()  # unused in this forward: contributes nothing
            elif grad.data_ptr() != view.data_ptr():
                if grad.is_sparse:
                    raise TypeError(f"the manual strategy needs dense gradients; {tuple(param.shape)} has a sparse one")
                view.copy_(grad)
            param.grad = view
        self.comm_calls += 1
        called = time.perf_counter()
        if self.algorithm == "torch":
            # Divide first (no fp16 overflow), then let the backend progress it while backward goes on.
            bucket.flat.div_(self.world_size)
            work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            work.get_future().then(lambda _: self.comm_timer.completed(called))
            self._pending.append(work)
            self.comm_timer.launched(called)
        else:
            comm.all_reduce(bucket.flat, op="avg", algorithm=self.algorithm, group=self.group, chunk_kb=self.chunk_kb)
            self.comm_timer.launched(called)
            self.comm_timer.completed(called)

    def _finish_backward(self) -> None:
        try:
            for bucket in self._buckets[self._next_bucket :]:  # never filled: some parameters unused
                self._launch(bucket)
            for work in self._pending:
                work.wait()
            self.comm_timer.syncs += 1
        finally:
            self._next_bucket = 0
            self._pending = []
            self._callback_queued = False
            for bucket in self._buckets:
                bucket.ready = [False] * len(bucket.params)


class ManualStrategy(ReplicatedStrategy):
    """ringtrain's own data parallelism (``BucketedDataParallel``) as a strategy for the training loop."""

    name = "manual"
    step_operation = "all_reduce (ringtrain's gradient buckets)"

    def __init__(self, device: torch.device, bucket_mb: float = 25.0, algorithm: str = "torch", chunk_kb: int | None = None,
                 group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        """The data-parallel ranks (None: every rank; beside tensor parallelism the dp sub-mesh's)."""
        self.bucket_mb = bucket_mb
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb
        self.comm_timer = CommTimer()

    def wrap(self, model: nn.Module) -> BucketedDataParallel:
        model.to(self.device)
        return BucketedDataParallel(model, self.bucket_mb, self.algorithm, self.chunk_kb, group=self.group,
                                    comm_timer=self.comm_timer)

    def no_sync(self, model: BucketedDataParallel) -> AbstractContextManager:
        """Skip gradient synchronisation for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: BucketedDataParallel, release: bool = False) -> nn.Module:
        """The wrapped module; ``release=True`` also ends the wrapping (``BucketedDataParallel.release``)."""
        if release:
            model.release()
        return model.module


def from_config(comm, device: torch.device, *, spec, diloco=None, heal: bool = False, mesh=None) -> ManualStrategy:
    """``comm.strategy = 'manual'`` (the registry's builder, ``ringtrain/strategies.py``) over the 1-D ``mesh``'s
    ranks (beside tensor parallelism: the data-parallel sub-mesh), or every rank."""
    return ManualStrategy(device, bucket_mb=comm.resolved_bucket_mb, algorithm=comm.algorithm, chunk_kb=comm.chunk_kb,
                          group=None if mesh is None else mesh.get_group())
