"""What every dataset builder returns: a train and a test set and the shapes a model needs."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

__all__ = ["DatasetSplit"]


@dataclass(frozen=True)
class DatasetSplit:
    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
