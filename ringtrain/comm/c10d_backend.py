"""ringtrain's shared-memory all-reduce as a ``torch.distributed`` backend, for collectives torch issues itself.

DTensor (tensor parallelism), FSDP2 and other torch code reach a group's collectives through c10d, not through
``ringtrain.comm``. Importing this module registers a backend, ``"ringtrain_shm"``, whose process groups run,
when all their ranks are on one host, on that host's shared memory: every sum all-reduce of a contiguous CPU
float tensor through ``comm.all_reduce(..., algorithm="shm")`` (the native path, on the group itself), and
all-gathers, reduce-scatters (sum, avg, max, min, product), broadcasts, all-to-alls (uneven splits too), the
other all-reduces and barriers through ``shm_ops`` on the same workspace, and sends and receives (so
``batch_isend_irecv``) through ``shm_p2p``'s channels. Everything else (gather, scatter, reduce, non-contiguous or non-CPU tensors, groups across hosts, the set-up's own exchange) goes to a
Gloo group over the same ranks and store (a recv from any source goes to Gloo where the group's sends do, and is
refused in one line where they go to shm: ``recv_anysource``). Each collective on shm records a profiler event
``ringtrain_shm:<op>`` (as Gloo's ``gloo:<op>``) and a flight-recorder entry::

    import ringtrain.comm.c10d_backend  # registers "ringtrain_shm"
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"), backend_override={"tp": "ringtrain_shm"})

torch's process groups may be written in Python (its threaded test group is): ``dist.ProcessGroup``'s methods
are virtual. The shm all-reduce is synchronous, so its work is returned complete; DTensor waits for the result
at first use anyway, and with one compute thread per worker nothing overlapped Gloo's either.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from collections import Counter

from torch._C._distributed_c10d import (
    AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions, BroadcastOptions, ReduceOp, ReduceScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

from ringtrain.comm import c10d_events, flight, shm_ops

__all__ = ["BACKEND", "ShmProcessGroup"]

BACKEND = "ringtrain_shm"
_SHM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ShmProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run on ringtrain's shared memory when its ranks share a host."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        """The same ranks over Gloo: every collective the shm path does not take (and shm's own set-up). It is
        this group's registered backend, so every method not overridden here is Gloo's (torch's ProcessGroup
        dispatches to its backend), and the group's name, which c10d sets on the backends, is kept there."""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.shm_calls = 0
        """Collectives that went through shared memory, every op (tests read it)."""
        self.shm_ops: Counter = Counter()
        """The same, per op (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``,
        ``barrier``): what the figures call ``tp_shm_all_reduces`` is ``shm_ops["all_reduce"]``."""
        self.shm_s = 0.0
        """Seconds spent in them: they run to completion inside the call, where a caller timing the waits for
        asynchronous collectives would not see them (the step breakdown's tp_comm adds this)."""
        self._shm = None
        self._building = False

    def getBackendName(self) -> str:
        return BACKEND

    # --- the shared-memory path ------------------------------------------------------------------------------
    def _built(self):
        """This group's ShmGroup, built (collectively) on the first collective; None while it is being built: the
        set-up's own exchange runs on Gloo."""
        if self._building:  # the set-up's exchanges (the workspace's, then the point-to-point segment's)
            return None
        sg = self._shm
        if sg is not None and sg.board is not None:
            return sg
        from ringtrain.comm.shm_group import get_shm_group

        self._building = True
        try:
            self._shm = get_shm_group(self)  # a new one if a heal destroyed the last (its board is gone)
            self._open_channels()
        finally:
            self._building = False
        return self._shm

    def _open_channels(self) -> None:
        """Collective, right after the workspace: the point-to-point segment (``shm_p2p``) of a group whose
        ranks are all on this host (its own exchange runs on Gloo)."""
        sg = self._shm
        if sg is not None and sg.p2p is None and shm_ops.fits(sg):
            from ringtrain.comm.shm_p2p import Channels

            sg.p2p = Channels(sg)

    def _workspace(self):
        """The ShmGroup when ``shm_ops`` can run on it (every rank on this host), else None (Gloo)."""
        sg = self._built()
        return sg if sg is not None and shm_ops.fits(sg) else None

    def init_shm(self, **options) -> None:
        """Collective: set up this group's workspace with ``comm.shm.init_shm``'s options (``small_kb``,
        ``piece_kb``), before its first collective; its own exchange runs on Gloo."""
        from ringtrain.comm.shm import init_shm

        self._building = True
        try:
            self._shm = init_shm(self, **options)
            self._open_channels()
        finally:
            self._building = False

    def _run(self, op: str, tensor: torch.Tensor, result, call) -> dist.Work:
        """Run ``call()`` on shm as collective ``op`` (profiler event, flight-recorder entry, accounting); a
        completed work holding ``result``."""
        entry = flight.begin(op, "shm", tensor)
        start = time.perf_counter()
        event = c10d_events.begin(op, [tensor])
        try:
            call()
        finally:
            c10d_events.end(event)
        self.shm_s += time.perf_counter() - start
        self.shm_calls += 1
        self.shm_ops[op] += 1
        flight.end(entry)
        done = Future()
        done.set_result(result)
        return _create_work_from_future(done)

    def _timeout_s(self) -> float:
        return self._shm.timeout_s

    def _on_gloo(self, op: str, inputs, call):
        """A call this group hands to Gloo (its tensors, dtype or op not shm's, the group across hosts, or not yet
        built): ``call()``'s work, inside a ``ringtrain_shm:<op>`` event while a profiler is on, as the calls it
        runs on shm have (Gloo's own ``gloo:<op>`` then lies inside it). Not the set-up's own exchanges: those
        are inside the first call's event."""
        event = None if self._building else c10d_events.begin(op, _tensors(inputs))
        work = call()
        return work if event is None else c10d_events.ProfiledWork(work, event)

    # --- point-to-point ----------------------------------------------------------------------------------------
    def _channels(self):
        """The point-to-point channels when this group's sends and receives can run on shm, else None (Gloo).
        They are made with the workspace, collectively: a group of two builds it on its first send or recv
        (both ranks take part in every message); a larger one on its first collective, and sends before that
        go to Gloo (as do receives, so the two sides agree)."""
        sg = self._shm
        if sg is None or sg.board is None:
            if self.size() != 2 or self._building:
                return None
            sg = self._built()
        return sg.p2p if sg is not None else None

    def _p2p(self, kind: str, tensors, peer: int, tag: int):
        """A posted shm ``send``/``recv`` of ``tensors[0]`` to/from group rank ``peer``, or None (Gloo's)."""
        if len(tensors) != 1 or not _takes(tensors) or not 0 <= peer < self.size() or peer == self.rank():
            return None
        channels = self._channels()
        if channels is None:
            return None
        tensor = tensors[0]
        start = time.perf_counter()
        event = c10d_events.begin(kind, [tensor])  # ends when the message has moved, as Gloo's does
        op = channels.post(kind, self._shm.local.index(peer), tensor, tag, flight.begin(kind, "shm", tensor))
        self.shm_s += time.perf_counter() - start
        self.shm_calls += 1
        self.shm_ops[kind] += 1
        return _P2PWork(self, channels, op, peer, event)

    def send(self, tensors, dstRank, tag=0):
        work = self._p2p("send", tensors, dstRank, tag)
        return work if work is not None else self._on_gloo("send", tensors, lambda: self.gloo.send(tensors, dstRank, tag))

    def recv(self, tensors, srcRank, tag=0):
        work = self._p2p("recv", tensors, srcRank, tag)
        return work if work is not None else self._on_gloo("recv", tensors, lambda: self.gloo.recv(tensors, srcRank, tag))

    def recv_anysource(self, tensors, tag=0):
        """A recv from any source (``dist.recv(t)`` with no ``src``) on Gloo, where this group's sends go to Gloo
        too; refused in one line where they go to shm. There the sender's bytes are on shm, where Gloo's recv
        would never see them (both sides waited out the group's timeout), and an answer from shm cannot be given:
        torch reads the sender from the work (``Work._source_rank()``), which a backend written in Python cannot
        provide (torch's trampoline for Python work objects forwards ``wait`` and ``get_future`` only)."""
        if self._channels() is not None:
            raise RuntimeError(
                "ringtrain_shm: a recv from any source cannot run on shared memory (torch cannot ask a Python backend "
                "who sent it); name the sender (dist.recv(tensor, src=RANK)) or put this group on gloo")
        return self._on_gloo("recvAnySource", tensors, lambda: self.gloo.recv_anysource(tensors, tag))

    # --- collectives -------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=AllreduceOptions()):
        op = _op_name(opts.reduceOp)
        if len(tensors) == 1 and _takes(tensors) and self._built() is not None:
            tensor = tensors[0]
            if op == "sum" and tensor.dtype in _SHM_DTYPES:  # across hosts too: the hierarchical all-reduce
                from ringtrain import comm

                start = time.perf_counter()
                event = c10d_events.begin("all_reduce", [tensor])
                try:
                    # It records its own flight-recorder entry (its native fast path does, in C++).
                    comm.all_reduce(tensor, "sum", algorithm="shm", group=self)
                finally:
                    c10d_events.end(event)
                self.shm_s += time.perf_counter() - start
                self.shm_calls += 1
                self.shm_ops["all_reduce"] += 1
                done = Future()
                done.set_result(tensors)
                return _create_work_from_future(done)
            if _reducible(tensor.dtype, op) and self._workspace() is not None:
                return self._run("all_reduce", tensor, tensors,
                                 lambda: shm_ops.all_reduce(self._shm, tensor, op, self._timeout_s()))
        return self._on_gloo("all_reduce", tensors, lambda: self.gloo.allreduce(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        if (len(input_tensors) == 1 and len(output_tensors) == 1 and _takes(input_tensors + output_tensors[0])
                and _alike(input_tensors[0], output_tensors[0], self.size()) and self._workspace() is not None):
            tensor, outputs = input_tensors[0], output_tensors[0]
            return self._run("all_gather", tensor, output_tensors,
                             lambda: shm_ops.all_gather(self._shm, outputs, tensor, self._timeout_s()))
        return self._on_gloo("all_gather", input_tensors, lambda: self.gloo.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output, input, opts=AllgatherOptions()):
        if (_takes([output, input]) and output.dtype == input.dtype and output.numel() == input.numel() * self.size()
                and self._workspace() is not None):
            outputs = list(output.view(-1).chunk(self.size())) if input.numel() else [output.view(-1)] * self.size()
            return self._run("all_gather", input, output,
                             lambda: shm_ops.all_gather(self._shm, outputs, input, self._timeout_s()))
        return self._on_gloo("all_gather", [input], lambda: self.gloo._allgather_base(output, input, opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        # ProcessGroup-only coalesced form (Gloo's backend has none): one call per tensor pair, the last work.
        works = [self._allgather_base(out, inp) for out, inp in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def reduce_scatter(self, output_tensors, input_tensors, opts=ReduceScatterOptions()):
        op = _op_name(opts.reduceOp)
        if (len(output_tensors) == 1 and len(input_tensors) == 1 and _takes(output_tensors + input_tensors[0])
                and _alike(output_tensors[0], input_tensors[0], self.size()) and _reducible(output_tensors[0].dtype, op)
                and self._workspace() is not None):
            output, inputs = output_tensors[0], input_tensors[0]
            return self._run("reduce_scatter", output, output_tensors,
                             lambda: shm_ops.reduce_scatter(self._shm, output, inputs, op, self._timeout_s()))
        return self._on_gloo("reduce_scatter", output_tensors,
                             lambda: self.gloo.reduce_scatter(output_tensors, input_tensors, opts))

    def _reduce_scatter_base(self, output, input, opts=ReduceScatterOptions()):
        op = _op_name(opts.reduceOp)
        if (_takes([output, input]) and output.dtype == input.dtype and input.numel() == output.numel() * self.size()
                and _reducible(output.dtype, op) and self._workspace() is not None):
            inputs = list(input.view(-1).chunk(self.size())) if output.numel() else [input.view(-1)] * self.size()
            return self._run("reduce_scatter", input, output,
                             lambda: shm_ops.reduce_scatter(self._shm, output, inputs, op, self._timeout_s()))
        return self._on_gloo("reduce_scatter", [input], lambda: self.gloo._reduce_scatter_base(output, input, opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        works = [self._reduce_scatter_base(out, inp, opts) for out, inp in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def broadcast(self, tensors, opts=BroadcastOptions()):
        if isinstance(tensors, torch.Tensor) or not isinstance(opts, BroadcastOptions):  # (tensor, root, timeout)
            return self._on_gloo("broadcast", [tensors], lambda: self.gloo.broadcast(tensors, opts))
        if len(tensors) == 1 and opts.rootTensor == 0 and _takes(tensors) and self._workspace() is not None:
            tensor = tensors[0]
            return self._run("broadcast", tensor, tensors,
                             lambda: shm_ops.broadcast(self._shm, tensor, opts.rootRank, self._timeout_s()))
        return self._on_gloo("broadcast", tensors, lambda: self.gloo.broadcast(tensors, opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=AllToAllOptions()):
        if _takes([output, input]) and output.dtype == input.dtype and self._workspace() is not None:
            outputs = _split(output, output_split_sizes, self.size())
            inputs = _split(input, input_split_sizes, self.size())
            if outputs is not None and inputs is not None:
                return self._run("all_to_all", input, output, lambda: shm_ops.all_to_all(
                    self._shm, outputs, inputs, input.dtype, self._timeout_s()))
        return self._on_gloo("all_to_all", [input], lambda: self.gloo.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts))

    def alltoall(self, output_tensors, input_tensors, opts=AllToAllOptions()):
        if (len(output_tensors) == len(input_tensors) == self.size() and _takes(list(output_tensors) + list(input_tensors))
                and len({t.dtype for t in list(output_tensors) + list(input_tensors)}) == 1
                and self._workspace() is not None):
            return self._run("all_to_all", input_tensors[0], output_tensors, lambda: shm_ops.all_to_all(
                self._shm, output_tensors, input_tensors, input_tensors[0].dtype, self._timeout_s()))
        return self._on_gloo("all_to_all", input_tensors, lambda: self.gloo.alltoall(output_tensors, input_tensors, opts))

    def barrier(self, opts=BarrierOptions()):
        if isinstance(opts, BarrierOptions) and self._workspace() is not None:
            return self._run("barrier", _NOTHING, None, lambda: shm_ops.barrier(self._shm, self._timeout_s()))
        return self._on_gloo("barrier", [], lambda: self.gloo.barrier(opts))


# torch 2.14's names for the single-tensor forms (dist.all_gather_single, reduce_scatter_single, all_to_all_single
# and their coalesced forms call these): the same collectives.
ShmProcessGroup.all_gather_single = ShmProcessGroup._allgather_base
ShmProcessGroup.all_gather_single_coalesced = ShmProcessGroup.allgather_into_tensor_coalesced
ShmProcessGroup.reduce_scatter_single = ShmProcessGroup._reduce_scatter_base
ShmProcessGroup.reduce_scatter_single_coalesced = ShmProcessGroup.reduce_scatter_tensor_coalesced
ShmProcessGroup.all_to_all_single = ShmProcessGroup.alltoall_base

# Every other collective goes to Gloo over the same ranks, called here rather than left to torch's ProcessGroup
# base methods: those dispatch to the registered backend too, but from a Python group they hung now and then
# (a scatter, 2 runs in 4 of 20 scatters each; delegated here, 5 of 5 passed).
_GLOO_EVENTS = {"allreduce_coalesced": ("all_reduce", 0), "allgather_coalesced": ("all_gather", 1),
                "gather": ("gather", 1), "reduce": ("reduce", 0), "scatter": ("scatter", 1)}
"""Gloo's calls that get a ``ringtrain_shm:<op>`` event (Gloo's own name for the op) too: the op, and which
argument holds the inputs."""
_TO_GLOO = ("allreduce_coalesced", "allgather_coalesced", "gather", "gather_into_tensor", "gather_single", "reduce",
            "scatter", "monitored_barrier")


def _to_gloo(name: str):
    op, inputs_at = _GLOO_EVENTS.get(name, (None, 0))

    def call(self, *args, **kwargs):
        event = c10d_events.begin(op, _tensors(args[inputs_at])) if op is not None and len(args) > inputs_at else None
        work = getattr(self.gloo, name)(*args, **kwargs)
        return work if event is None else c10d_events.ProfiledWork(work, event)

    call.__name__ = name
    return call


for _name in _TO_GLOO:
    setattr(ShmProcessGroup, _name, _to_gloo(_name))

class _P2PWork(dist.Work):
    """A shm send or recv: ``wait`` moves its bytes (and those of every other pending one of this rank, so that
    peers that both send first never deadlock) until it is done, or fails naming the peer in one line."""

    def __init__(self, group: ShmProcessGroup, channels, op, peer: int, event=None):
        super().__init__()
        self._group, self._channels, self._op, self._peer, self._event = group, channels, op, peer, event

    def _ended(self) -> None:
        event, self._event = self._event, None
        c10d_events.end(event)

    def wait(self, timeout=None) -> bool:
        if not self._op.done:
            start = time.perf_counter()
            self._channels.wait(self._op, self._group._timeout_s())
            self._group.shm_s += time.perf_counter() - start
        self._ended()
        return True

    def is_completed(self) -> bool:
        if not self._op.done:
            self._channels.progress()
        if self._op.done:
            self._ended()
        return self._op.done

    def is_success(self) -> bool:
        return self._op.done

    def _source_rank(self) -> int:
        return self._peer


_NOTHING = torch.empty(0, dtype=torch.uint8)
_OP_NAMES = ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "avg"), (ReduceOp.MAX, "max"), (ReduceOp.MIN, "min"),
             (ReduceOp.PRODUCT, "product"))
_REDUCIBLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
"""Dtypes shm reduces (complex: sum and avg only, through the real view); others go to Gloo."""


def _tensors(inputs) -> list[torch.Tensor]:
    """The tensors of a call's input argument (a tensor, a list of them, or a list of lists), for the event's shapes."""
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, (list, tuple)):
        return [t for item in inputs for t in _tensors(item)]
    return []


def _op_name(op) -> str | None:
    for known, name in _OP_NAMES:
        try:
            if op == known:
                return name
        except TypeError:  # a premultiplied sum and other ops c10d builds: Gloo's
            return None
    return None


def _reducible(dtype: torch.dtype, op: str | None) -> bool:
    if op is None or dtype not in _REDUCIBLE:
        return False
    if dtype.is_complex:
        return op in ("sum", "avg")
    if op == "avg":
        return dtype.is_floating_point
    return True


def _takes(tensors) -> bool:
    """Plain contiguous CPU tensors (dense, not quantized): the shm path's; anything else is Gloo's."""
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
               and not t.is_quantized for t in tensors)


def _alike(tensor: torch.Tensor, others, size: int) -> bool:
    """``others``: one tensor per rank, each of ``tensor``'s dtype and element count."""
    return len(others) == size and all(o.dtype == tensor.dtype and o.numel() == tensor.numel() for o in others)


def _split(tensor: torch.Tensor, split_sizes, size: int) -> list[torch.Tensor] | None:
    """All-to-all's pieces of ``tensor`` along dimension 0 (even without ``split_sizes``), or None where they do not
    fit the tensor (Gloo then says what is wrong)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    sizes = list(split_sizes) if split_sizes else ([rows // size] * size if tensor.dim() and rows % size == 0 else None)
    if sizes is None or len(sizes) != size or any(s < 0 for s in sizes) or sum(sizes) != rows:
        return None
    return list(tensor.split(sizes)) if rows else [tensor] * size


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    return ShmProcessGroup(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
