"""The trainer's sharded checkpoints (``[checkpoint] sharded`` / ``async``): the model's and optimizer's
tensors go through ``ShardedCheckpointer`` (each rank its shard, DCP), everything else of the trainer's state
(sampler, counters, precision, config) as rank 0's weights-only ``extra.pt`` beside them.

The strategy gives the model and optimizer state in the layout it holds (``strategy.checkpoint_state``):
plain tensors under DDP and the manual strategy (DCP writes each once, through torch's ``get_state_dict``),
DTensor shards under FSDP2, each rank's stretches of the flat shards under zero1/2/3
(``parallel/zero_state.py``), all in ``get_state_dict``'s keys. Loading into another layout (another number
of workers, another strategy) is DCP's resharding (``strategy.load_checkpoint_state``). The optimizer's
param_groups are not stored: its hyperparameters follow the config on resume, as with full checkpoints
(train/optim.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoint.sharded import PendingSave, ShardedCheckpointer
from ringtrain.parallel.base import ReplicatedStrategy

__all__ = ["save_sharded", "load_sharded"]


def save_sharded(checkpointer: ShardedCheckpointer, step: int, strategy: ReplicatedStrategy, model: nn.Module,
                 optimizer: torch.optim.Optimizer, extra: dict[str, Any], async_save: bool,
                 **manifest_fields: Any) -> PendingSave:
    """``model``: the strategy's wrapped model."""
    return checkpointer.save(step, strategy.checkpoint_state(model, optimizer), async_save=async_save,
                             extra=extra if checkpointer.rank == 0 else None, **manifest_fields)


def load_sharded(checkpointer: ShardedCheckpointer, path: Path, strategy: ReplicatedStrategy, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load ``path``'s model and optimizer tensors into this run's layout; return its ``extra``."""
    extra = checkpointer.load_extra(path)
    strategy.load_checkpoint_state(model, optimizer, lambda state: checkpointer.load(path, state))
    return extra
