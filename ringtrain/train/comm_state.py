"""Per-rank state of the gradient sync, for checkpoints: PowerSGD's error feedback differs on every rank.

Gathered to the checkpoint's writer (rank 0) like any other tensor: one gather per checkpoint, and a
checkpoint that grows by ``world_size`` copies of the state (for PowerSGD about 4 bytes per parameter per
rank, plus the small low-rank factors). Strategies without such state add nothing and no collective.

    state["comm"] = gather_rank_states(strategy)      # every rank calls it; rank 0 gets the list
    strategy.load_state_dict(state["comm"][rank])
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ringtrain.comm.objects import gather_weights_only

__all__ = ["gather_rank_states"]


def gather_rank_states(strategy: Any) -> list[dict[str, Any]] | None:
    """Every rank's ``strategy.state_dict()`` in rank order on rank 0 (None elsewhere, and None when the
    strategy keeps no per-rank state). A collective when it has some: every rank calls it."""
    if not strategy.has_rank_state:
        return None
    mine = strategy.state_dict()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    # Read back as a checkpoint is: weights-only (tensors, numbers, strings, containers), never a pickled object.
    return gather_weights_only(mine, dst=0)
