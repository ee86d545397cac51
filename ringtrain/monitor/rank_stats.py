"""One collective per logged step that tells rank 0 about every rank: loss, busy time, memory.

The slowest rank of an interval (the straggler) is the one with the most busy time (data loading plus
forward/backward, the work the others end up waiting for in the gradient all-reduce); its lag is how much
longer it took than the fastest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RankStats", "gather_rank_stats"]


@dataclass(frozen=True)
class RankStats:
    loss_sum: float
    """Sum over ranks of their loss sums."""
    slowest_rank: int
    lag_s: float
    """Busy time of the slowest rank minus that of the fastest, per step."""
    peak_rss_mb: float
    """Largest peak resident memory over ranks."""
    model_state_mb: float = 0.0
    """Largest model state (parameters, gradients, optimizer state, strategy buffers) over ranks."""


def gather_rank_stats(loss_sum: float, busy_s: float, peak_rss_mb: float, model_state_mb: float = 0.0) -> RankStats:
    """All ranks call this at the same step; every rank gets the same answer."""
    if dist.get_world_size() == 1:  # nothing to gather
        return RankStats(loss_sum=loss_sum, slowest_rank=0, lag_s=0.0, peak_rss_mb=peak_rss_mb,
                         model_state_mb=model_state_mb)
    mine = torch.tensor([loss_sum, busy_s, peak_rss_mb, model_state_mb], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    # Gloo takes CPU tensors; NCCL would need them on the device.
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
        rows = [row.cuda() for row in rows]
    dist.all_gather(rows, mine)
    table = torch.stack(rows).cpu()
    busy = table[:, 1]
    slowest = int(torch.argmax(busy))
    return RankStats(
        loss_sum=float(table[:, 0].sum()),
        slowest_rank=slowest,
        lag_s=float(busy[slowest] - busy.min()),
        peak_rss_mb=float(table[:, 2].max()),
        model_state_mb=float(table[:, 3].max()),
    )
