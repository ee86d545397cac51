"""ringtrain's shared-memory all-reduce as a ``torch.distributed`` backend, for collectives torch issues itself.

DTensor (tensor parallelism) and other torch code reach a group's collectives through c10d, not through
``ringtrain.comm``. Importing this module registers a backend, ``"ringtrain_shm"``, whose process groups run
every sum all-reduce of a contiguous CPU float tensor through ``comm.all_reduce(..., algorithm="shm")`` (the
native path, on the group itself) and hand everything else (gathers, broadcasts, other ops and dtypes, the
set-up's object exchange) to a Gloo group over the same ranks and store::

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
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, _create_work_from_future
from torch.futures import Future

__all__ = ["BACKEND", "ShmProcessGroup"]

BACKEND = "ringtrain_shm"
_SHM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ShmProcessGroup(dist.ProcessGroup):
    """A process group whose sum all-reduces of CPU float tensors run on ringtrain's shared memory."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        """The same ranks over Gloo: every collective the shm path does not take (and shm's own set-up). It is
        this group's registered backend, so every method not overridden here is Gloo's (torch's ProcessGroup
        dispatches to its backend), and the group's name, which c10d sets on the backends, is kept there."""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.shm_calls = 0
        """All-reduces that went through shared memory (tests read it)."""
        self.shm_s = 0.0
        """Seconds spent in them: they run to completion inside the call, where a caller timing the waits for
        asynchronous collectives would not see them (the step breakdown's tp_comm adds this)."""

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=AllreduceOptions()):
        if opts.reduceOp == ReduceOp.SUM and all(_shm_fits(t) for t in tensors):
            from ringtrain import comm

            start = time.perf_counter()
            for tensor in tensors:
                comm.all_reduce(tensor, "sum", algorithm="shm", group=self)
            self.shm_s += time.perf_counter() - start
            self.shm_calls += 1
            done = Future()
            done.set_result(tensors)
            return _create_work_from_future(done)
        return self.gloo.allreduce(tensors, opts)

    # ProcessGroup-only coalesced forms (Gloo's backend has none): one call per tensor pair, the last work.
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.gloo._allgather_base(out, inp) for out, inp in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.gloo._reduce_scatter_base(out, inp, *(() if opts is None else (opts,)))
                 for out, inp in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]


# Every other collective goes to Gloo over the same ranks, called here rather than left to torch's ProcessGroup
# base methods: those dispatch to the registered backend too, but from a Python group they hung now and then
# (a scatter, 2 runs in 4 of 20 scatters each; delegated here, 5 of 5 passed).
_TO_GLOO = ("allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base", "all_gather_single",
            "all_gather_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "barrier", "broadcast",
            "gather", "gather_into_tensor", "gather_single", "reduce", "reduce_scatter", "_reduce_scatter_base",
            "reduce_scatter_single", "reduce_scatter_single_coalesced", "scatter", "send", "recv",
            "recv_anysource", "monitored_barrier")


def _to_gloo(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.gloo, name)(*args, **kwargs)

    call.__name__ = name
    return call


for _name in _TO_GLOO:
    setattr(ShmProcessGroup, _name, _to_gloo(_name))


def _shm_fits(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in _SHM_DTYPES and tensor.is_contiguous()


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    return ShmProcessGroup(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
