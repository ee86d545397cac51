"""The trainer's sharded checkpoints (``[checkpoint] sharded`` / ``async``): the model's and optimizer's
tensors go through ``ShardedCheckpointer`` (each rank its shard, DCP), everything else of the trainer's state
(sampler, counters, precision, config) as rank 0's weights-only ``extra.pt`` beside them.

torch's ``get_state_dict`` / ``set_state_dict`` give the model and optimizer state in the layout the strategy
holds: plain tensors under DDP and the manual strategy (DCP writes each once), DTensor shards under FSDP2.
Loading into another layout (another number of workers, or DDP <-> FSDP2) is DCP's resharding. The
optimizer's param_groups are not stored: its hyperparameters follow the config on resume, as with full
checkpoints (train/optim.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ringtrain.checkpoint.sharded import PendingSave, ShardedCheckpointer

__all__ = ["save_sharded", "load_sharded"]


def save_sharded(checkpointer: ShardedCheckpointer, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                 extra: dict[str, Any], async_save: bool, **manifest_fields: Any) -> PendingSave:
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return checkpointer.save(step, {"model": model_sd, "optimizer": optim_sd}, async_save=async_save,
                             extra=extra if checkpointer.rank == 0 else None, **manifest_fields)


def load_sharded(checkpointer: ShardedCheckpointer, path: Path, module: nn.Module,
                 optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load ``path``'s model and optimizer tensors into this run's layout; return its ``extra``."""
    extra = checkpointer.load_extra(path)
    model_sd, optim_sd = get_state_dict(module, optimizer)  # the layout (and AdamW's moments) to fill
    state = {"model": model_sd, "optimizer": optim_sd}
    checkpointer.load(path, state)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return extra
