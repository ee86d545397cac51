"""Leaving a generation's process group: at once when it failed, the ordinary way at an admission."""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from ringtrain.comm import shm_group
from ringtrain.group.sockets import forget_group_sockets, shutdown_group_sockets

__all__ = ["abandon_group", "forget_mesh_caches"]


def abandon_group(failed: bool = True) -> None:
    """Leave the default group (and every group made from it) without waiting on it. A ``failed`` group's
    collectives failed, so nothing of it is waited for again: its TCP sockets are shut down first
    (``group/sockets.py``: the default group's and those of the groups ringtrain made beside it, such as
    sharded checkpoints' own), which tells a peer still blocked in one of its collectives (on a live rank) that
    the group is gone at once, not after timeout_s, and makes a collective of this rank still in flight on it
    fail, so the destroy returns at once instead of waiting for it until timeout_s. (``failed=False``: a
    healthy group left at a step boundary to admit a joiner, with nothing in flight: closed the ordinary way.)

    Objects that hung off the group (a DDP wrapper's reducer, whose autograd hooks would otherwise fire on
    the next backward) must be dropped by the caller first; the collection here frees them, so the group is
    destroyed here, never later in a garbage collection. Its shared-memory workspace
    (``comm.algorithm = "shm"``) goes too, with any segment a dead peer left named in /dev/shm."""
    if failed:
        shutdown_group_sockets()
    forget_group_sockets()
    forget_mesh_caches()
    gc.collect()
    if dist.is_initialized():
        shm_group.destroy(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass  # already half torn down by the failure: nothing left to close


def forget_mesh_caches() -> None:
    """Drop what DTensor cached about the meshes of the group left. A DeviceMesh equals another of the same ranks,
    shape and dimension names whatever its process groups (torch's ``DeviceMesh.__eq__``), so the sharding
    propagation cache would hand a mesh of the next generation the output specs computed on an equal mesh of
    an earlier one, whose groups are gone ("Could not resolve the process group registered under the name N"):
    seen when an admission brought a split model back to the layout it had before a heal. Nothing to do in a
    process that never made a DTensor."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
