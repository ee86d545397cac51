"""Datasets, the resumable distributed sampler and the loaders built on them."""

from __future__ import annotations

from ringtrain.config import DataConfig
from ringtrain.data.digits import load_digits_split
from ringtrain.data.loader import StepBatch, build_eval_loader, build_train_loader
from ringtrain.data.sampler import ResumableSampler, eval_shard
from ringtrain.data.split import DatasetSplit

__all__ = [
    "DatasetSplit",
    "ResumableSampler",
    "StepBatch",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
    "eval_shard",
]


def build_datasets(config: DataConfig) -> DatasetSplit:
    """The train/test split named by ``[data] dataset``."""
    if config.dataset == "digits":
        return load_digits_split(config.test_fraction, config.split_seed)
    raise ValueError(f"unknown dataset {config.dataset!r}")  # unreachable: the config validates the name
