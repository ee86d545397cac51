"""DiLoCo (Douillard et al., arXiv 2311.08105): workers train alone for H steps, then average what they learned.

Each worker runs the configured (inner) optimizer on its own shares of the data with no gradient sync at all.
Every ``sync_every`` (H) optimizer steps, and at the run's last step, each worker computes its pseudo-gradient
``global - local`` (fp32), the workers average it with ringtrain's collectives (``comm.all_reduce``, the same
call and algorithms as the manual strategy: torch, ring, ring_chunked, shm, hierarchical across hosts), an outer
SGD (momentum, Nesterov) steps the global parameters by it, and every worker takes the new global parameters.
LocalSGD is ``outer_lr=1, outer_momentum=0``: the new global parameters are then the workers' mean.

Streaming DiLoCo (arXiv 2501.18512), torchft's ``local_sgd.py`` constraints:

- ``fragments`` F: the parameters are cut, in model order, into F contiguous fragments of about equal size;
  fragment f syncs after the steps s with ``s % H == (f + 1) * H / F % H``: one fragment every H / F steps, in
  turn, each every H steps (F = 1: the whole model every H steps). Peak bandwidth falls F times.
- ``delay`` tau: a fragment's pseudo-gradient is taken and exchanged tau steps before its outer step is
  applied; the inner steps in between go on, and are then overwritten by the new global values (torchft's
  ``fragment_update_alpha = 0``). With ``comm.algorithm = 'torch'`` the exchange is an asynchronous op that
  those tau steps overlap; ringtrain's own algorithms exchange at once (the same numbers, no overlap yet).
- ``dtype``: the pseudo-gradients travel as fp32 (all-reduced), or as bf16, int8 or int4 packets
  (``comm/codec.py``) that are all-gathered and summed in fp32 in rank order (the same bits on every rank),
  with error feedback: what a worker's packet lost is added to its next pseudo-gradient of that fragment, so
  nothing a worker learned is dropped, only delayed (kept per rank in its checkpointed state).

Replicas (``inner``; the INTELLECT-1 shape): with ``inner = 'host'`` the workers of one host are one DiLoCo
replica. They train as one data-parallel model, their gradients averaged every step by torch DDP over the
host's ranks (its all-reduce ``comm.algorithm``: 'shm' keeps it in shared memory), and only each host's first
rank (its leader) exchanges pseudo-gradients with the other hosts' leaders; the leader hands the mean to its
host's other ranks (a broadcast inside the host). ``'worker'``: every worker is a replica (no gradient sync at
all). ``'auto'`` (default): 'host' when the job spans hosts and some host runs more than one worker (the host
layout ``comm.groups.host_id`` finds, as the shm all-reduce does), else 'worker'.

Beside a split model (the layout's cp, tp or pp) a replica is a whole model-parallel group, whatever ``inner`` says.
Beside cp (``model_groups``): each cp group, its ranks one model reading one sequence's parts, DDP inside it, its
leader exchanging, as 'host' replicas. Beside tp or pp the split model's strategy runs the inner steps with the
group's own collectives and averages nothing over dp; it builds with this strategy as its ``outer_loop`` and
``attach``es it to this rank's parts (DTensors' local shards, its stages' parameters) and the layout's dp group:
every rank exchanges its own part with its counterparts. Its outer state is those parts: a sharded checkpoint holds
them, each rank's under keys of its own, and resumes at the layout that wrote them; a full checkpoint (rank 0's
replica) cannot (``diloco_state.SplitOuterState``: a resume refuses in one line).

The run's last step syncs every fragment at once (a pending exchange is superseded: the pseudo-gradient taken
then covers every inner step since the fragment's last outer step), so a run ends with one model everywhere.

    >>> strategy = DiLoCoStrategy(torch.device("cpu"), sync_every=50, outer_lr=0.7, outer_momentum=0.9)
    >>> model = strategy.wrap(model)                 # rank 0's weights everywhere; the fp32 global copy
    >>> optimizer = strategy.shard_optimizer(inner)  # kept: its per-rank state goes into checkpoints
    >>> loss_fn(model(x)).backward(); optimizer.step()    # local: nothing is communicated
    >>> if strategy.outer_loop.sync_due(step, last=step == total_steps):
    ...     strategy.outer_loop.outer_step()         # one all-reduce of the pseudo-gradients

What a checkpoint holds beyond the model and optimizer (rank 0's): ``outer`` (``stateful_parts``: the global
parameters, the outer optimizer's momentum, the count of outer steps, identical on every rank) and every rank's own
parameters and inner optimizer state, which differ between outer steps: a checkpoint taken inside an interval
resumes bit for bit. A full checkpoint gathers them to rank 0 (``has_rank_state``, ``train/comm_state.py``); a
sharded one has each rank write its own through DCP under keys only it holds (``train/stateful.ShardedTensors``
for the model and inner optimizer, ``diloco_state.OuterState.sharded_state_dict`` for the error feedback) and the outer state
once. At another world size the workers start from the checkpoint's model, with one warning.

Buffers (BatchNorm statistics) are not averaged: they follow rank 0 at each outer step (one broadcast, counted
in the bytes). Evaluation scores the global model (``evaluation_weights``: ringtrain train's evaluations and a
Session's ``eval_loader`` swap it in), not each worker's own parameters between outer steps.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.comm import codec, shm
from ringtrain.comm.groups import host_id, resolve_group
from ringtrain.comm.objects import all_gather_json, broadcast_weights_only
from ringtrain.errors import ConfigError
from ringtrain.layout import MODEL_DIMS
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.testing import faults
from ringtrain.parallel.base import ReplicatedStrategy, optimizer_tensors
from ringtrain.parallel.buckets import broadcast_from_rank0, live_group
from ringtrain.parallel.ddp import DDPStrategy
from ringtrain.parallel.diloco_state import OuterState, SplitOuterState
from ringtrain.parallel.outer_loop import OuterLoop

__all__ = ["from_config", "DiLoCoStrategy", "OuterState", "split_fragments", "replicas_of", "model_groups", "SplitOuterState",
           "INNER"]

INNER = ("auto", "worker", "host")
"""What one DiLoCo replica is (module docstring)."""


# torch 2.14 renamed all_gather_into_tensor (deprecated, with a warning on every call); the range pyproject
# accepts starts before the rename.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Fragment:
    """One fragment's parameters, their global fp32 copies and its exchange buffer; between the exchange and
    the outer step of a delayed sync, the state of that exchange."""

    def __init__(self, index: int, params: list[nn.Parameter], globals_: list[torch.Tensor], offset: int):
        self.index, self.params, self.globals, self.offset = index, params, globals_, offset
        self.numel = sum(p.numel() for p in params)
        self.error: torch.Tensor | None = None  # error feedback (compressed dtypes): what packets lost so far
        self.in_flight = False  # exchanged (or exchanging), its outer step not applied yet
        self.synced_step = 0  # the step of its last outer step (0: the run's, or this group's, start)
        self.mean: torch.Tensor | None = None  # the averaged pseudo-gradient, once known
        self.work: dist.Work | None = None  # the asynchronous exchange (algorithm 'torch' with a delay)
        self.error_before: torch.Tensor | None = None  # ``error`` before the exchange in flight (to supersede it)


def split_fragments(numels: list[int], fragments: int) -> list[int]:
    """Where each of ``fragments`` contiguous fragments starts, over tensors of ``numels`` elements: cut at
    the tensor closest to each equal share, no fragment empty while there are tensors left.

    >>> split_fragments([10, 10, 10, 10], 2)
    [0, 2]
    """
    if fragments > len(numels):
        raise ConfigError(f"diloco.fragments = {fragments} but the model has {len(numels)} trainable tensors; "
                         f"set diloco.fragments to at most {len(numels)}")
    total, starts, running = sum(numels), [0], 0
    cumulative = []
    for n in numels:
        running += n
        cumulative.append(running)
    for f in range(1, fragments):
        target = total * f / fragments
        # The first tensor index after which the running total is closest to the target.
        best = min(range(starts[-1] + 1, len(numels) - (fragments - f) + 1),
                   key=lambda i: abs(cumulative[i - 1] - target))
        starts.append(best)
    return starts


def replicas_of(hosts: list[str], inner: str) -> list[list[int]]:
    """The replicas, as lists of ranks (each in rank order, the first its leader), for ranks on ``hosts`` (one
    entry per rank) and ``inner`` ('auto', 'worker' or 'host'); in the order of their first ranks.

    >>> replicas_of(["a", "a", "b", "b"], "auto")
    [[0, 1], [2, 3]]
    >>> replicas_of(["a", "a", "a"], "auto")
    [[0], [1], [2]]
    """
    if inner not in INNER:
        raise ValueError(f"inner {inner!r} is unknown; choose one of {', '.join(INNER)}")
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    if inner == "auto":
        inner = "host" if len(by_host) > 1 and any(len(r) > 1 for r in by_host.values()) else "worker"
    if inner == "worker":
        return [[rank] for rank in range(len(hosts))]
    return list(by_host.values())


def model_groups(mesh: Any) -> list[list[int]]:
    """The replicas beside a split model: each model-parallel group of the layout's ``mesh`` (its ``MODEL_DIMS``,
    innermost, so a group is consecutive in the mesh's order), in rank order, the first its leader. A context-
    parallel group holds one model whose ranks read one sequence's parts: it trains as one replica (its gradients
    averaged inside it every step), and only its leader exchanges pseudo-gradients with the other groups'."""
    names = mesh.mesh_dim_names or ()
    size = 1
    for name in names:
        if name in MODEL_DIMS:
            size *= mesh.size(names.index(name))
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


class DiLoCoStrategy(ReplicatedStrategy):
    """Inner steps without communication; every ``sync_every`` steps one outer step on the averaged
    pseudo-gradient, in ``fragments`` turns (module docstring)."""

    name = "diloco"
    gradients_replicated = False
    """Each worker's gradient is its own (no sync): the step agreement carries every rank's gradient flag."""
    has_rank_state = True
    """Every rank's own parameters and inner optimizer state are checkpointed (``state_dict``)."""

    @property
    def outer_loop(self) -> DiLoCoStrategy:
        """The outer loop's hooks (``outer_loop.OuterLoop``: ``sync_due``, ``outer_step``, ``evaluation_weights``,
        ``end_of_run``, ``abandon_interval``, ``transfer_parts``, ``take_over``) are this strategy's own."""
        return self

    def __init__(self, device: torch.device, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, algorithm: str = "torch", chunk_kb: int | None = None, fragments: int = 1,
                 delay: int = 0, dtype: str = "fp32", inner: str = "auto", bucket_mb: float = 25.0,
                 hosts: list[str] | None = None, mesh: Any = None):
        if sync_every <= 0:
            raise ValueError(f"sync_every must be positive, got {sync_every}")
        if fragments <= 0 or sync_every % fragments:
            raise ValueError(f"sync_every ({sync_every}) must be divisible by fragments ({fragments})")
        if not 0 <= delay < sync_every // fragments:
            raise ValueError(f"delay ({delay}) must be below sync_every / fragments ({sync_every // fragments})")
        if dtype != "fp32" and dtype not in codec.DTYPES:
            raise ValueError(f"dtype {dtype!r} is unknown; choose fp32 or one of {', '.join(codec.DTYPES)}")
        if inner not in INNER:
            raise ValueError(f"inner {inner!r} is unknown; choose one of {', '.join(INNER)}")
        self.device = device
        self.inner, self.bucket_mb, self._hosts = inner, bucket_mb, hosts
        self._mesh = mesh
        self._attached = False
        """The outer loop of a split model's strategy (``attach``): this rank holds its parts of the model."""
        """The layout's device mesh beside a split model (context parallelism): a replica is a model-parallel
        group (``model_groups``), whatever ``inner`` says."""
        self.sync_every, self.fragment_count, self.delay, self.dtype = sync_every, fragments, delay, dtype
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb if algorithm == "ring_chunked" else None
        self.comm_timer = CommTimer()
        self.outer_steps = 0
        """Fragment outer steps applied over the whole run (checkpointed); F per H steps."""
        self.bytes_sent = 0
        """Bytes this worker has put on the wire for outer steps (its pseudo-gradients, rank 0's buffers)."""
        self._module: nn.Module | None = None
        self._ddp: DDPStrategy | None = None  # the data parallelism inside a replica of several ranks
        self.replicas: list[list[int]] = []
        """The replicas' ranks (``replicas_of``), once wrapped."""
        self._inner: torch.optim.Optimizer | None = None
        self._apart = False  # an inner step came after the last whole sync
        self._step = 0  # the last optimizer step sync_due was told of
        self._dropped: set[int] = set()
        """Fragments whose exchange a failed group took with it: their next outer step is skipped (the next
        exchange covers every inner step since their last one)."""

    # --- set-up ---------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Rank 0's weights on every rank, the replicas, the fp32 global copy, the fragments and the outer
        optimizer. Returns the module itself where every worker is a replica (nothing to synchronise in
        backward), else the module in DDP over this rank's replica. Collective over every rank."""
        model.to(self.device)
        group = resolve_group(None)
        self._group = weakref.ref(group)  # never keep a destroyed group alive
        with torch.no_grad():
            broadcast_from_rank0([p.data for p in model.parameters()] + list(model.buffers()), group)
        self._module = model
        wrapped = self._form_replicas(model, group)
        self._build_outer([p for p in model.parameters() if p.requires_grad])
        return wrapped

    def attach(self, module: nn.Module, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        """The outer loop beside a split model (tensor or pipeline parallelism, whose strategy runs the inner
        steps with its own collectives and averages nothing over the data-parallel ranks): ``params`` are this
        rank's parts of the model (a DTensor's local shard, its stages' parameters), the same parts as its peers
        in ``group`` hold (the layout's ``dp`` dimension: the ranks at this rank's model-parallel coordinates), and
        every rank exchanges its own parts' pseudo-gradients over ``group``. The split model's strategy has put
        rank 0's weights everywhere already. Collective over ``group`` (none here)."""
        self._group = weakref.ref(group)
        self._module = module
        self._attached = True
        self.replicas = [[r] for r in range(dist.get_world_size(group))]
        self.is_leader = True
        self._exchange, self._replica = weakref.ref(group), None
        with torch.no_grad():  # the local tensors are views of the parameters: steps and copies reach both
            self._build_outer([p.to_local() if hasattr(p, "to_local") else p for p in params if p.requires_grad])

    @property
    def syncs_replicas(self) -> bool:
        """The data-parallel replicas of a split model are kept together by the outer steps, not by a gradient
        average: their strategy averages nothing over dp (``attach``)."""
        return True

    def _build_outer(self, params: list[torch.Tensor]) -> None:
        """The fp32 global copy of ``params``, the fragments, the exchange buffers and the outer optimizer."""
        model = self._module
        self._params = params
        self.global_params = [p.detach().to(torch.float32, copy=True) for p in self._params]
        # torch's SGD refuses nesterov without momentum; with none the two are the same step anyway.
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.nesterov and self.outer_momentum > 0)
        starts = split_fragments([p.numel() for p in self._params], self.fragment_count)
        bounds = list(zip(starts, [*starts[1:], len(self._params)]))
        per = self.sync_every // self.fragment_count
        self.fragments = [_Fragment(f, self._params[a:b], self.global_params[a:b], (f + 1) * per % self.sync_every)
                          for f, (a, b) in enumerate(bounds)]
        exchange = self.exchange_group
        world = len(self.replicas)
        for fragment in self.fragments:
            if self.dtype == "fp32":
                fragment.buffer = self._buffer(fragment.numel, torch.float32, exchange)
                fragment.wire_bytes = fragment.numel * 4
            else:
                # Each replica's packet in its own slot; a slot a multiple of 64 bytes, so that comm.all_gather's
                # cut (tensor_shards: shards on cache lines) is exactly the slots.
                fragment.wire_bytes = codec.packet_bytes(fragment.numel, self.dtype)
                fragment.slot = -(-fragment.wire_bytes // 64) * 64
                fragment.buffer = self._buffer(fragment.slot * world, torch.uint8, exchange)
                fragment.error = torch.zeros(fragment.numel, dtype=torch.float32, device=self.device)
        self._buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    def _form_replicas(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        """Agree on the replicas (every rank gathers the hosts); where one has several ranks, make each
        replica's group (DDP inside it) and the leaders' group (the exchange). Collective over ``group``."""
        rank = dist.get_rank(group)
        if self._mesh is not None:
            self.replicas = model_groups(self._mesh)
        else:
            hosts = self._hosts or [str(h) for h in all_gather_json(host_id(), group=group)]
            if len(hosts) != dist.get_world_size(group):
                raise ValueError(f"hosts has {len(hosts)} entries for {dist.get_world_size(group)} ranks")
            self.replicas = replicas_of(hosts, self.inner)
        mine = next(r for r in self.replicas if rank in r)
        self.is_leader = rank == mine[0]
        if all(len(r) == 1 for r in self.replicas):
            self._exchange, self._replica = weakref.ref(group), None
            return model
        # Every rank makes every group, in one order (torch's rule for new_group).
        replica_groups = [dist.new_group(r) for r in self.replicas]
        leaders = dist.new_group([r[0] for r in self.replicas])
        replica = replica_groups[self.replicas.index(mine)]
        self._replica = weakref.ref(replica)
        self._replica_leader = mine[0]
        self._exchange = weakref.ref(leaders) if self.is_leader else None
        self._ddp = DDPStrategy(self.device, bucket_mb=self.bucket_mb, algorithm=self.algorithm,
                                chunk_kb=self.chunk_kb, comm_timer=self.comm_timer, group=replica)
        return self._ddp.wrap(model)

    def _buffer(self, numel: int, dtype: torch.dtype, group: dist.ProcessGroup | None) -> torch.Tensor:
        if self.algorithm == "shm" and group is not None:
            return shm.shared_empty(numel, dtype, group)  # peers read it in place
        return torch.empty(numel, dtype=dtype, device=self.device)

    @property
    def group(self) -> dist.ProcessGroup:
        return live_group(self._group)

    @property
    def exchange_group(self) -> dist.ProcessGroup | None:
        """The group the pseudo-gradients are exchanged in: every rank, or the replicas' leaders (None on a rank
        that is not one: it gets the mean from its leader)."""
        return None if self._exchange is None else live_group(self._exchange)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """This rank's replica's group (DDP's), where a replica has several ranks."""
        return None if self._replica is None else live_group(self._replica)

    @property
    def step_operation(self) -> str:
        """An inner step synchronises nothing where every worker is a replica; inside a replica of several ranks,
        DDP's all-reduce over its group."""
        if self._ddp is None:
            return "forward and backward (DiLoCo inner step: no collective)"
        return "all_reduce (DDP gradient sync inside this DiLoCo replica)"

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        # Replicas of one worker never synchronise in backward; DDP inside a replica skips its all-reduce.
        return nullcontext() if self._ddp is None else self._ddp.no_sync(model)

    def unwrap(self, model: nn.Module, release: bool = False) -> nn.Module:
        return model if self._ddp is None else self._ddp.unwrap(model)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The inner optimizer, whole; kept, so that its per-rank state goes into checkpoints."""
        self._inner = optimizer
        return optimizer

    # --- the outer step -------------------------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        """Bytes each worker sends per H steps: every fragment's pseudo-gradient once (fp32, or its packet),
        plus rank 0's buffers."""
        return sum(f.wire_bytes for f in self.fragments) + self._buffer_bytes

    def _prepares(self, fragment: _Fragment, step: int) -> bool:
        return (step + self.delay) % self.sync_every == fragment.offset

    def _applies(self, fragment: _Fragment, step: int) -> bool:
        return step % self.sync_every == fragment.offset

    def sync_due(self, step: int, last: bool = False) -> bool:
        """Whether ``outer_step(step, last)`` has work after optimizer step ``step``: a fragment's exchange or
        outer step falls on it, or it is the run's last. Called after every committed step."""
        self._apart = True  # an inner step since the last whole sync: the ranks' parameters differ
        self._step = step
        return last or any(self._prepares(f, step) or self._applies(f, step) for f in self.fragments)

    @contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Inside the block the module holds the global parameters (the model the outer steps made, the same on
        every rank); this worker's own come back after it. Between outer steps the workers' parameters differ:
        scoring each rank's share of the eval set with its own would blend several models into one number."""
        if not self._apart:
            yield
            return
        own = [p.detach().clone() for p in self._params]
        with torch.no_grad():
            for p, g in zip(self._params, self.global_params):
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self._params, own):
                    p.copy_(saved)

    def end_of_run(self) -> None:
        """A run that ends before its planned last step (a loop that left early) ends on one model too."""
        if self._apart:
            self.outer_step()

    def outer_step(self, step: int | None = None, last: bool = False) -> None:
        """After optimizer step ``step``: take and exchange the pseudo-gradient of every fragment that prepares
        now, and apply the outer step of every fragment whose turn it is. ``step=None`` or ``last``: every
        fragment syncs at once (a pending exchange superseded)."""
        called = time.perf_counter()
        whole = step is None or last
        with torch.no_grad():
            for fragment in self.fragments:
                if whole:
                    self._supersede(fragment)
                    self._prepare(fragment)
                    self._apply(fragment)
                    continue
                if self._prepares(fragment, step):
                    self._prepare(fragment)
                if self._applies(fragment, step):
                    self._apply(fragment)
            # Buffers (BatchNorm statistics) follow rank 0, once per H steps: with the fragment that syncs at
            # multiples of H, and at a whole sync.
            if whole or any(self._applies(f, step) and f.offset == 0 for f in self.fragments):
                broadcast_from_rank0(list(self._module.buffers()), self.group)
                self.bytes_sent += self._buffer_bytes
        if whole:
            self._apart = False
        self.comm_timer.completed(called)  # time/comm_s; the loop books the wait as phase outer_sync

    def _prepare(self, fragment: _Fragment) -> None:
        """This worker's pseudo-gradient of ``fragment`` (plus what its packets lost before) is sent; the mean
        over workers follows (``_mean``)."""
        delta = torch.cat([(g - p.detach().to(torch.float32)).reshape(-1)
                           for g, p in zip(fragment.globals, fragment.params)])
        fragment.in_flight, fragment.mean = True, None
        faults.point("diloco.exchange")
        exchange = self.exchange_group  # None: a replica's other rank, whose leader exchanges for it
        if exchange is not None:
            self.bytes_sent += fragment.wire_bytes
        overlap = self.delay > 0 and self.algorithm == "torch"
        if self.dtype == "fp32":
            fragment.buffer.copy_(delta)
            if exchange is None:
                return
            if overlap:  # summed: ``_exchanged_mean`` divides once it is done
                fragment.work = dist.all_reduce(fragment.buffer, group=exchange, async_op=True)
            else:
                comm.all_reduce(fragment.buffer, op="avg", algorithm=self.algorithm, group=exchange,
                                chunk_kb=self.chunk_kb)
            return
        # A replica's ranks hold the same parameters: each computes the same packet and error feedback.
        fragment.error_before = fragment.error.clone()
        delta += fragment.error
        slot = 0 if exchange is None else dist.get_rank(exchange)
        mine = fragment.buffer[slot * fragment.slot : (slot + 1) * fragment.slot]
        packet = codec.encode(delta, self.dtype, out=mine)
        fragment.error.copy_(delta - codec.decode(packet, self.dtype, fragment.numel))
        if exchange is None:
            return
        if overlap:
            fragment.work = _all_gather_single(fragment.buffer, mine.clone(), group=exchange, async_op=True)
        else:
            comm.all_gather(fragment.buffer, algorithm=self.algorithm, group=exchange, chunk_kb=self.chunk_kb)

    def _mean(self, fragment: _Fragment) -> torch.Tensor:
        """The mean pseudo-gradient of ``fragment``'s exchange (waiting for it if it is in flight). Where a
        replica has several ranks, its leader hands the mean on (a broadcast in the replica: every rank of it
        calls this at the same point)."""
        if fragment.mean is not None:
            return fragment.mean
        if self.exchange_group is not None:
            fragment.mean = self._exchanged_mean(fragment)
        else:
            fragment.mean = torch.empty(fragment.numel, dtype=torch.float32, device=self.device)
        replica = self.replica_group
        if replica is not None and dist.get_world_size(replica) > 1:
            dist.broadcast(fragment.mean, src=self._replica_leader, group=replica)
        return fragment.mean

    def _exchanged_mean(self, fragment: _Fragment) -> torch.Tensor:
        world = len(self.replicas)
        if self.dtype == "fp32":
            if fragment.work is not None:  # torch's asynchronous all_reduce sums
                fragment.work.wait()
                fragment.work = None
                fragment.buffer.div_(world)
            return fragment.buffer
        if fragment.work is not None:
            fragment.work.wait()
            fragment.work = None
        mean = torch.zeros(fragment.numel, dtype=torch.float32, device=self.device)
        for r in range(world):  # in rank order: the same sum, to the bit, on every rank
            mean += codec.decode(fragment.buffer[r * fragment.slot : (r + 1) * fragment.slot], self.dtype,
                                 fragment.numel)
        return mean.div_(world)

    def _apply(self, fragment: _Fragment) -> None:
        """The outer step on ``fragment``'s global parameters by its mean pseudo-gradient; every worker takes them."""
        if not fragment.in_flight and fragment.index in self._dropped:
            self._dropped.discard(fragment.index)  # its exchange went with a failed group (``abandon_interval``)
            return
        if not fragment.in_flight:  # the schedule's own invariant: never step on a buffer nothing was sent into
            raise RuntimeError(f"DiLoCo: fragment {fragment.index}'s outer step came with no exchange before it")
        mean = self._mean(fragment)
        for g in self.global_params:
            g.grad = None  # torch's SGD skips (and keeps the momentum of) a parameter without a gradient
        offset = 0
        for g in fragment.globals:
            g.grad = mean[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer_optimizer.step()
        for g, p in zip(fragment.globals, fragment.params):
            p.copy_(g)
            g.grad = None
        fragment.in_flight, fragment.mean, fragment.error_before = False, None, None
        fragment.synced_step = self._step
        self.outer_steps += 1

    def _supersede(self, fragment: _Fragment) -> None:
        """An exchange in flight is dropped (a whole sync takes a newer pseudo-gradient); what its packet lost
        is taken back out of the error feedback, as the packet is never applied."""
        if not fragment.in_flight:
            return
        if fragment.work is not None:
            fragment.work.wait()  # every rank waits on the same op: the collectives stay in order
            fragment.work = None
        if fragment.error_before is not None:
            fragment.error.copy_(fragment.error_before)
        fragment.in_flight, fragment.mean, fragment.error_before = False, None, None

    # --- healing (ringtrain/heal/supervisor.py) ---------------------------------------------------------
    def abandon_interval(self) -> int:
        """The group failed (a worker was lost): every exchange in flight goes with it (its error feedback taken
        back), and this worker's parameters go back to the global ones, the model of the last outer step that
        every survivor holds. A heal restarts the interval from there: what every worker learned since each
        fragment's last outer step is dropped (its samples stay used: the ledger counts them once, as dealt).
        Returns the inner steps dropped (since the oldest fragment's last outer step), for the heal's record."""
        if self._module is None:  # a joiner whose first group failed: it never trained
            return 0
        for fragment in self.fragments:
            if fragment.in_flight:
                fragment.work = None  # the failed group's op: never waited on
                if fragment.error_before is not None:
                    fragment.error.copy_(fragment.error_before)
                fragment.in_flight, fragment.mean, fragment.error_before = False, None, None
                self._dropped.add(fragment.index)
        with torch.no_grad():
            for param, global_ in zip(self._params, self.global_params):
                param.copy_(global_)
        self._apart = False
        return max((self._step - f.synced_step for f in self.fragments), default=0)

    def transfer_parts(self) -> dict[str, Any]:
        """What a heal's transfer carries beyond the trainer's parts: the outer state (a joiner has none)."""
        return {"outer": OuterState(self)}

    def take_over(self, old: OuterLoop, optimizer: torch.optim.Optimizer,
                  received: dict[str, Any] | None = None) -> None:
        """A heal's new group: this strategy, just wrapped around the same module (which holds the global
        parameters on every member), goes on from ``old``'s outer state, or from the outer state ``received``
        in the transfer (a joiner, or a member that was behind), and steps ``optimizer`` (the inner one, kept)."""
        self._inner = optimizer
        if received is not None:
            OuterState(self).load_state_dict(received["outer"])
        elif isinstance(old, DiLoCoStrategy) and old._module is not None:
            OuterState(self).load_state_dict(OuterState(old).state_dict())
            if self.dtype != "fp32":
                for new_fragment, old_fragment in zip(self.fragments, old.fragments, strict=True):
                    new_fragment.error.copy_(old_fragment.error)
        with torch.no_grad():  # the module is the global model already (``abandon_interval``, a whole sync)
            for param, global_ in zip(self._params, self.global_params):
                param.copy_(global_)
        self._share_inner_state()

    def _share_inner_state(self) -> None:
        """Inside a replica of several ranks (DDP over its group) every rank must step the same inner optimizer
        state, or its ranks drift apart at the next inner step. A heal's new group may put into one replica a
        joiner (holding the state it received from a rank of another replica) or ranks that trained in
        different replicas: the leader's state becomes every member's. Collective over each replica's group."""
        replica = self.replica_group
        if replica is None or self._inner is None:
            return
        leader = self._replica_leader
        state = broadcast_weights_only(self._inner.state_dict() if dist.get_rank() == leader else None, leader, replica)
        if dist.get_rank() != leader:
            self._inner.load_state_dict(state)

    def figures(self) -> dict[str, Any]:
        """For records and the summary: fragment outer steps so far, the bytes per H steps (a replica's), those
        this worker sent between replicas (none from a replica's other ranks, but rank 0's buffers), and how
        many replicas there are."""
        return {"outer_steps": self.outer_steps, "outer_payload_bytes": self.payload_bytes,
                "comm_bytes_per_worker": self.bytes_sent, "diloco_replicas": len(self.replicas)}

    # --- state ----------------------------------------------------------------------------------------
    def stateful_parts(self) -> dict[str, Any]:
        """The checkpoint's parts beyond the model and optimizer: the outer state, the same on every rank (beside a
        split model each rank's parts of it, which only a sharded checkpoint holds: ``SplitOuterState``)."""
        return {"outer": SplitOuterState(self) if self._attached else OuterState(self)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state (gathered by ``train/comm_state.py``): its parameters, inner optimizer state
        and, for compressed pseudo-gradients, its error feedback."""
        state = {"params": [p.detach().clone() for p in self._params],
                 "inner_optimizer": self._inner.state_dict() if self._inner is not None else {}}
        if self.dtype != "fp32":
            state["error"] = [f.error.clone() for f in self.fragments]
            state["error_before"] = [None if f.error_before is None else f.error_before.clone()
                                     for f in self.fragments]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for param, saved in zip(self._params, state["params"], strict=True):
                param.copy_(saved)
            if self.dtype != "fp32":
                # None saved (a run that exchanged fp32 before): the error feedback starts from nothing.
                errors = state.get("error") or [None] * len(self.fragments)
                befores = state.get("error_before") or [None] * len(self.fragments)
                for fragment, error, before in zip(self.fragments, errors, befores, strict=True):
                    fragment.error.copy_(error if error is not None else torch.zeros_like(fragment.error))
                    fragment.error_before = None if before is None else before.clone()
        if self._inner is not None and state["inner_optimizer"]:
            # The state only: hyperparameters follow this run's config (the lr schedule is positioned already).
            current = self._inner.state_dict()
            self._inner.load_state_dict({"state": state["inner_optimizer"]["state"],
                                         "param_groups": current["param_groups"]})

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        yield from super().state_tensors(model, optimizer)
        yield from self.global_params
        for fragment in self.fragments:
            yield fragment.buffer
            if fragment.error is not None:
                yield fragment.error
        yield from optimizer_tensors(self.outer_optimizer)


def from_config(comm, device: torch.device, *, spec, diloco=None, heal: bool = False, mesh=None) -> DiLoCoStrategy:
    """``comm.strategy = 'diloco'`` with the [diloco] section (its defaults when None); ``heal``: a --heal job
    (its replicas are formed again from each new group's hosts, ``_form_replicas``); ``mesh``: the layout's beside
    a split model, whose model-parallel groups are the replicas (``model_groups``)."""
    from ringtrain.config import DiLoCoConfig

    diloco = diloco or DiLoCoConfig()
    return DiLoCoStrategy(device, sync_every=diloco.sync_every, outer_lr=diloco.outer_lr,
                          outer_momentum=diloco.outer_momentum, nesterov=diloco.nesterov,
                          algorithm=comm.algorithm, chunk_kb=comm.chunk_kb, fragments=diloco.fragments,
                          delay=diloco.delay, dtype=diloco.dtype,
                          inner=diloco.inner,
                          bucket_mb=comm.resolved_bucket_mb, mesh=mesh)
