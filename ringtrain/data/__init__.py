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
    # Imported on use: torchvision is not needed to train on text, nor the corpus to train on images.
    if config.dataset == "digits":
        return load_digits_split(config.test_fraction, config.split_seed)
    if config.dataset == "digits_images":
        from ringtrain.data.images import load_digits_images

        return load_digits_images(config)
    if config.dataset == "imagefolder":
        from ringtrain.data.images import load_image_folder

        return load_image_folder(config)
    if config.dataset == "synthetic_images":
        from ringtrain.data.images import load_synthetic_images

        return load_synthetic_images(config)
    if config.dataset == "text":
        from ringtrain.data.text import load_text_split

        return load_text_split(config.path, config.seq_len, config.test_fraction)
    raise ValueError(f"unknown dataset {config.dataset!r}")  # unreachable: the config validates the name
