"""Set-up shared by ringtrain's own strategies (manual, zero): rank 0's state everywhere, parameter buckets.

    >>> broadcast_from_rank0([p.data for p in module.parameters()], group)   # as DDP starts
    >>> bucket_parameters(trainable, bucket_bytes=4 << 20)                   # [[p9, p8], [p7, ...], ...]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.comm.groups import global_rank

__all__ = ["broadcast_from_rank0", "bucket_parameters", "live_group"]


def live_group(ref) -> dist.ProcessGroup:
    """The group a strategy holds weakly (a destroyed group must not be kept alive by a wrapped model)."""
    group = ref()
    if group is None:
        raise RuntimeError("this model's process group was destroyed; wrap the module again in a live group")
    return group


def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Rank 0's values into ``tensors`` on every rank: one broadcast per dtype, not one per tensor."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    source = global_rank(group, 0)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def bucket_parameters(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Reverse registration order (the order backward usually produces gradients: DDP's heuristic), at most
    ``bucket_bytes`` each (a bigger parameter gets its own), one dtype and device per bucket."""
    groups: list[list[nn.Parameter]] = []
    open_groups: dict[tuple, tuple[list[nn.Parameter], int]] = {}
    for param in reversed(params):
        key = (param.dtype, param.device)
        members, size = open_groups.get(key, ([], 0))
        nbytes = param.numel() * param.element_size()
        if members and size + nbytes > bucket_bytes:
            groups.append(members)
            members, size = [], 0
        open_groups[key] = (members + [param], size + nbytes)
    groups.extend(members for members, _ in open_groups.values() if members)
    return groups
