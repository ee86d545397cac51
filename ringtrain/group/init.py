"""Process-group lifetime: backend choice, loopback-bound store, Gloo bound to the job's address, thread count;
the host's tuning (core pinning, the allocator) comes from ringtrain/host/.

``init_distributed`` is a context manager so the group is destroyed even when training raises.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ringtrain.comm import flight
from ringtrain.config import DistConfig
from ringtrain.group.auth_store import AuthStore
from ringtrain.group.env import DistEnv
from ringtrain.group.sockets import forget_group_sockets, recording_group_sockets
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.host.allocator import keep_freed_memory
from ringtrain.host.pinning import cores_for_worker, host_placement, pin_compute_threads, warn
from ringtrain.layout import MODEL_DIMS, Layout

__all__ = ["DistContext", "init_distributed", "prepare_process", "leave_default_group", "resolve_backend",
           "interface_for_address", "bind_gloo_groups"]


@dataclass(frozen=True)
class DistContext:
    """What a worker knows about its place in the job once the process group is up."""

    env: DistEnv
    backend: str
    device: torch.device
    host_rank: int
    """Index of this worker among the workers on its host (equals local_rank with one agent per host)."""
    host_world_size: int
    layout: Layout | None = None
    """How the ranks divide the work (``on_layout``); None: every rank is a data rank of its own."""
    mesh: Any = None
    """The job's device mesh (``Layout.build_mesh``), None when the layout needs none."""
    dp: tuple[int, int] | None = None
    """(rank, size) in the data-parallel dimension when the model is split across ranks (the ranks of one
    tensor-, context- or pipeline-parallel group read the same samples). None: every rank is a data rank of its
    own."""
    dp_group: dist.ProcessGroup | None = None
    """The ranks that read different samples and share this rank's place in the model (data sums, the sample
    ledger and token counts run over it); None: the whole group."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different samples (its rank without model parallelism)."""
        return self.env.rank if self.dp is None else self.dp[0]

    @property
    def dp_size(self) -> int:
        """How many ranks read different samples: the data-parallel degree (the world size without model
        parallelism)."""
        return self.env.world_size if self.dp is None else self.dp[1]

    @property
    def gradient_ranks(self) -> int:
        """The ranks the data-parallel strategy averages a gradient over: the data-parallel ranks, and with
        context parallelism their cp groups too (each cp rank holds its tokens' share of the gradient, so the
        step scales its loss by this, not dp_size, and the average over dp x cp is the sum over cp)."""
        return self.dp_size * (self.layout.cp if self.layout is not None else 1)

    @property
    def data_leader(self) -> bool:
        """This rank speaks for its samples in sums over ranks (the first rank of its model-parallel group, by
        its mesh coordinates: its peers hold the same samples and count nothing, so nothing is counted twice)."""
        if self.dp is None:
            return True
        names = self.mesh.mesh_dim_names
        return all(self.mesh.get_local_rank(name) == 0 for name in MODEL_DIMS if name in names)

    def on_layout(self, layout: Layout, tp_algorithm: str = "torch") -> DistContext:
        """This context with ``layout``'s mesh built (every rank calls it, once) and this rank's data-parallel
        coordinates read from it. ``tp_algorithm = 'shm'``: the ``tp`` dimension's groups are ringtrain's
        shared-memory backend (``comm/c10d_backend.py``; CPU workers), so DTensor's all-reduces run there."""
        if layout.world_size != self.world_size:
            raise ConfigError(f"the layout {layout.describe()} has {layout.world_size} ranks, but this group has "
                              f"{self.world_size}; resolve it at this world size")
        tp_backend = None
        if tp_algorithm == "shm" and layout.tp > 1:
            if self.device.type != "cpu":
                raise ConfigError(f"[parallel] tp_algorithm = 'shm' needs CPU workers, but this worker trains on "
                                  f"{self.device}; set tp_algorithm = 'torch'")
            from ringtrain.comm.c10d_backend import BACKEND

            tp_backend = BACKEND
        # The mesh's groups are recorded with the default group's sockets (group/sockets.py): a healed group that
        # fails shuts them down too, so a live peer blocked in a tp/pp/dp collective learns of it at once.
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        with recording_group_sockets(store, append=True):
            mesh = layout.build_mesh(self.device.type, tp_backend)
        if mesh is None or layout.model_parallel == 1:  # every rank reads samples of its own
            return dataclasses.replace(self, layout=layout, mesh=mesh, dp=None, dp_group=None)
        dp_mesh = mesh["dp"]
        return dataclasses.replace(self, layout=layout, mesh=mesh, dp=(dp_mesh.get_local_rank(), layout.dp),
                                   dp_group=dp_mesh.get_group())


def resolve_backend(requested: str) -> str:
    """'auto' -> NCCL when CUDA is available, else Gloo; an impossible request is a user error."""
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    if requested == "nccl" and not has_cuda:
        raise LaunchError("dist.backend = 'nccl' needs CUDA GPUs and none is available; use 'gloo' or 'auto'")
    return requested


@contextmanager
def init_distributed(env: DistEnv | None = None, config: DistConfig | None = None,
                     store: dist.Store | None = None) -> Iterator[DistContext]:
    """Create the default process group for this worker and destroy it on the way out.

    ``env`` defaults to what torchrun (or ``ringtrain run``) set in the environment, ``config`` to
    ``DistConfig()`` (Gloo on CPU, NCCL on GPUs; pinned compute threads); ``store``, where the ranks meet,
    to the one ``env`` names (a worker admitted by a --heal job meets in the job store)::

        with ringtrain.init_distributed() as ctx:
            print(ctx.rank, ctx.world_size, ctx.device)
    """
    env = DistEnv.from_environ() if env is None else env
    config = DistConfig() if config is None else config
    backend, device = prepare_process(env, config)
    timeout = timedelta(seconds=config.timeout_s)
    store = _build_store(env, timeout) if store is None else store
    with recording_group_sockets(store):  # a heal shuts them down under a peer blocked on them (sockets.py)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    try:
        host_rank, host_world_size = host_placement(env.bind_addr)
        if device.type == "cpu" and config.pin_cpu and hasattr(os, "sched_setaffinity"):
            allowed = sorted(os.sched_getaffinity(0))
            cores = cores_for_worker(host_rank, host_world_size, config.threads_per_worker, allowed, warn)
            pin_compute_threads(cores)
        yield DistContext(env, backend, device, host_rank, host_world_size)
    finally:
        leave_default_group()


def prepare_process(env: DistEnv, config: DistConfig) -> tuple[str, torch.device]:
    """What a worker sets up before it meets any group (``init_distributed`` does it first; a worker joining a
    --heal job does it before its group forms): backend and device, compute threads, the allocator, the
    address collectives bind to, the flight recorder. Returns (backend, device)."""
    backend = resolve_backend(config.backend)
    torch.set_num_threads(config.threads_per_worker)
    device = _device_for(backend, env.local_rank)
    if device.type == "cpu" and config.keep_freed_memory:
        keep_freed_memory()  # before the model and data allocate anything
    if env.bind_addr:
        _bind_collectives_to(env.bind_addr)
    bind_gloo_groups(env.bind_addr)  # every Gloo group of this worker: the default one, new_group's, a heal's
    # The flight recorder: ringtrain's collectives, and torch's record of the group's (read at creation).
    flight.torch_recorder_env(config.flight_recorder)
    flight.enable(config.flight_recorder)
    return backend, device


def leave_default_group() -> None:
    """Destroy the default group if it is still there (a worker fenced off while healing has left it already).
    DDP keeps the group alive from inside reference cycles: collected now, not at the interpreter's shutdown,
    where a Gloo thread would free a tensor after Python is gone and abort."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_group_sockets()


def interface_for_address(address: str) -> str:
    """Name of the network interface that holds ``address`` (e.g. '127.0.0.1' -> 'lo')."""
    ip = socket.gethostbyname(address)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    known = sorted(
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET
    )
    raise LaunchError(f"{address} is not an address of this host; pass --local-addr with one of {known}")


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _bind_collectives_to(address: str) -> None:
    # NCCL picks its interface from NCCL_SOCKET_IFNAME; Gloo groups that torch makes outside its backend
    # registry (see bind_gloo_groups), e.g. the checker of TORCH_DISTRIBUTED_DEBUG=DETAIL, from
    # GLOO_SOCKET_IFNAME. Without them those bind to whatever the host name resolves to, which can be a
    # public interface.
    interface = interface_for_address(address)
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["NCCL_SOCKET_IFNAME"] = interface


_gloo_address: str | None = None
"""The address every Gloo group this process makes listens on (``bind_gloo_groups``); None: torch's choice."""


def bind_gloo_groups(address: str | None) -> None:
    """Make every Gloo group this process creates from now on (``init_process_group``, ``new_group``, a heal's
    next generation) listen on, and connect from, ``address``; None: torch's own choice again.

    Torch chooses a Gloo group's address itself: the first address of the interface ``GLOO_SOCKET_IFNAME``
    names, else the one the host name resolves to. On an interface with two addresses (198.18.7.1, and the
    job's 198.18.7.101) every worker listened on the first. Gloo takes an address when its device is made
    (``ProcessGroupGloo.create_device(hostname=...)``), but torch 2.14 drops the options that would carry
    the device (``pg_options``) for Gloo; so the device is made where torch makes every Gloo backend, the
    creator registered for "gloo", here replaced by one that adds it. One switch for the whole process,
    like the environment variable it replaces: no call site can forget it.
    """
    global _gloo_address
    _gloo_address = address
    if address is not None:
        dist.Backend.register_backend("gloo", _create_gloo_backend, extended_api=True,
                                      devices=dist.Backend.backend_capability["gloo"],
                                      _backend_type=dist.ProcessGroup.BackendType.GLOO)


def _create_gloo_backend(opts, backend_options: object | None) -> dist.ProcessGroupGloo:
    """torch's Gloo creator (``_create_gloo_process_group``), with a device on ``_gloo_address`` if one is set."""
    from torch.distributed.distributed_c10d import _create_gloo_process_group

    address = _gloo_address
    if address is None:
        return _create_gloo_process_group(opts, backend_options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = opts.timeout
    # Lazy or not as torch's own would be: TORCH_GLOO_LAZY_INIT, read now (group/sockets.py lifts it in an init).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options.enable_reconfigure = opts.enable_reconfigure
    backend = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    backend.options.global_ranks_in_group = opts.global_ranks_in_group
    backend.options.group_name = opts.group_id
    return backend


_stores: dict[tuple, tuple[dist.Store, int]] = {}
"""The store each rendezvous address gave this process, and how many groups met on it so far."""


def _build_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """Where the ranks meet. A process that makes a second default group at the same address (a script that
    calls ``ringtrain.fit`` twice) meets on the same store under a fresh prefix: rank 0's store still listens
    on MASTER_PORT (hosting it again fails with "address in use"), and the first group's keys are still in it.
    Every rank makes its groups in the same order, so every rank picks the same prefix."""
    if not env.is_distributed:
        return dist.HashStore()
    key = (env.master_addr, env.master_port, env.use_agent_store, env.restart_count, env.rank)
    store, groups = _stores.get(key) or (_new_store(env, timeout), 0)
    _stores[key] = (store, groups + 1)
    return store if groups == 0 else dist.PrefixStore(f"/group_{groups + 1}", store)


def _new_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    store = _connect_store(env, timeout)
    if env.job_secret is None:
        return store
    # Every value the ranks exchange here (Gloo's addresses, the groups' keys) sealed with the job's secret: a
    # stranger who reaches the port cannot hand a rank an address or a value (group/auth.py).
    return AuthStore(store, env.job_secret, where=f"the workers' store at {env.master_addr}:{env.master_port}")


def _connect_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    if env.use_agent_store:
        # Plain torchrun shares its rendezvous store; the prefix keeps restarts apart, as torch's env:// does.
        client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"/worker/attempt_{env.restart_count}", client)
    if env.rank == 0:
        # torch's TCPStore listens on every interface; hand it a socket bound to one address instead.
        listener = _listen_on(env.bind_addr or env.master_addr, env.master_port)
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)


def _listen_on(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, port), family=family, backlog=1024)
    except OSError as err:
        raise LaunchError(f"cannot listen on {address}:{port} ({err.strerror}); choose another port") from None
