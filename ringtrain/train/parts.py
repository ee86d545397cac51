"""TrainParts: everything the Trainer works on, built beforehand by ``build_trainer``."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ringtrain.data.ledger import NullLedger
from ringtrain.data.sampler import ResumableSampler
from ringtrain.group.jobstore import NullJobStore
from ringtrain.parallel import Strategy
from ringtrain.train.batch_size import MicroBatcher
from ringtrain.train.keep_best import BestModel
from ringtrain.train.precision import Precision
from ringtrain.train.tasks import Task

__all__ = ["TrainParts"]


@dataclass
class TrainParts:
    """Everything the trainer works on, built beforehand by ``build_trainer``."""

    model: nn.Module
    """The model as wrapped by the strategy (the module itself until a joining worker's group forms)."""
    module: nn.Module
    """The model itself, unwrapped."""
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    sampler: ResumableSampler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    """None: no evaluation set."""
    task: Task
    total_steps: int
    """Optimizer steps of the whole run (the lr schedule spans them)."""
    precision: Precision
    batcher: MicroBatcher
    ledger: NullLedger = field(default_factory=NullLedger)
    """Records each step's sample ids (``[data] ledger``); the null ledger records nothing."""
    job_store: NullJobStore = field(default_factory=NullJobStore)
    """Keys that outlive the workers: progress and heartbeats (``group/jobstore.py``)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The user's torchmetrics, {name: Metric}, computed over the evaluation set (synchronised by torchmetrics)."""
    data_stats: dict[str, Any] = field(default_factory=dict)
    """Facts about the data for the summary (e.g. a text corpus's unigram entropy)."""
    checkpointed_blocks: int = 0
    """Blocks under activation checkpointing (``[train] activation_checkpointing``; 0 with 'none')."""
    best: BestModel = field(default_factory=lambda: BestModel(None))
    """``[train] keep_best``: the best evaluation's model, kept in RUN_DIR/best/ (the null keeper keeps nothing)."""
    loaders: Callable[[int, int], tuple[DataLoader, DataLoader | None]] | None = None
    """(rank, world_size) -> the train and eval loaders for another group (healing rebuilds them)."""
