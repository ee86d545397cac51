"""What every dataset builder returns: a train and a test set and the shapes a model needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

__all__ = ["DatasetSplit"]


@dataclass(frozen=True)
class DatasetSplit:
    train: Dataset
    test: Dataset
    num_classes: int
    """Classes of a classifier; for text, the vocabulary size."""
    input_shape: tuple[int, ...]
    """One sample's input shape; for text, (seq_len,), the longest sequence."""
    collate_fn: Callable[[list], Any] | None = None
    """How to batch samples (None: torch's default_collate); text pads variable-length sequences."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Facts about the data for the run's summary (e.g. the text corpus's unigram entropy)."""
