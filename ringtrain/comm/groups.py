"""What the algorithms need to know about a process group: sizes, ranks, neighbours, timeout."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist

from ringtrain.comm.shm_segment import SHM_DIR

__all__ = ["resolve_group", "group_size", "group_rank", "global_rank", "group_timeout_s", "host_id"]

_FALLBACK_TIMEOUT_S = 1800.0  # torch's default for non-NCCL groups


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``None`` means the default group, as everywhere in torch.distributed."""
    if not dist.is_initialized():
        raise RuntimeError(
            "ringtrain.comm needs an initialised process group; call torch.distributed.init_process_group first"
        )
    return dist.group.WORLD if group is None else group


def group_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def global_rank(group: dist.ProcessGroup, rank_in_group: int) -> int:
    """The rank a user sees in logs (default group) for a rank of ``group``."""
    if group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def group_timeout_s(group: dist.ProcessGroup, device: torch.device | None = None) -> float:
    """The group's own timeout (``init_process_group(timeout=...)``, i.e. ``[dist] timeout_s``)."""
    device = device or torch.device("cpu")
    try:
        backend = group._get_backend(device)
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):  # a backend without options, or none for this device
        return _FALLBACK_TIMEOUT_S
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


@cache
def host_id() -> str:
    """Which host this process is on, as ranks that share memory see it:
    ``name/boot id/net namespace/shm mount``.

    The host name alone is fooled by network namespaces (and containers) on one machine: they share the
    host name, yet their ranks talk over different network stacks and must be told apart. The kernel's
    boot id (random at every boot) tells machines apart even with equal names; the inode of this process's
    network namespace tells namespaces apart. And the device of ``/dev/shm``: containers that share a
    network namespace (a pod's) may each have a ``/dev/shm`` of their own, where one cannot open the
    segment another made; every tmpfs mount has a device number of its own, while one mount seen from two
    mount namespaces (or bind-mounted twice) keeps its number, as it keeps its files. Two processes get the
    same id only if they run on the same boot of the same kernel, in one network namespace, with one
    ``/dev/shm``::

        >>> host_id()
        'node7/b335b17e/net:4026531833/shm:26'
    """
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: the host name is all there is
        return name
    try:
        shm = f"/shm:{os.stat(SHM_DIR).st_dev}"
    except OSError:  # no /dev/shm: nothing is shared through it either
        shm = ""
    return f"{name}/{boot}/net:{netns}{shm}"
