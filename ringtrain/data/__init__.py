"""Datasets, the resumable distributed sampler and the loaders built on them."""

from __future__ import annotations

from pathlib import Path

from ringtrain.config import DataConfig
from ringtrain.data.digits import load_digits_split
from ringtrain.data.loader import StepBatch, build_eval_loader, build_train_loader
from ringtrain.data.sampler import ResumableSampler, eval_shard
from ringtrain.data.split import DatasetSplit
from ringtrain.errors import ConfigError

__all__ = [
    "DatasetSplit",
    "ResumableSampler",
    "StepBatch",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
    "check_data",
    "eval_shard",
]

_IMAGENET_LAYOUT = "a folder holding train/<class>/*.jpg and val/<class>/*.jpg"


def check_data(config: DataConfig) -> None:
    """The files ``[data]`` names exist and split into training and validation data: one line naming the fix
    otherwise (``ConfigError``). The launcher calls it before any worker starts; ``build_datasets`` too."""
    if config.factory is not None:
        return
    if config.dataset == "imagefolder":
        if config.path is None:
            raise ConfigError(f"data.path is required for data.dataset = 'imagefolder'; set it to {_IMAGENET_LAYOUT}")
        root = Path(config.path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"data.path '{config.path}' not found; set it to {_IMAGENET_LAYOUT}")
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ConfigError(f"data.path '{config.path}' has no {split}/ folder; it must be {_IMAGENET_LAYOUT}")
    if config.dataset == "text":
        from ringtrain.data.text import corpus_files, split_files

        files = corpus_files(config.path)
        if not files:
            raise ConfigError(
                f"data.path '{config.path}' matched no files; give a folder, a file or a glob such as "
                "'corpus/**/*.txt' ('{stdlib}' is Python's standard library folder)"
            )
        train_files, val_files = split_files(files, config.test_fraction)
        if not train_files or not val_files:
            raise ConfigError(
                f"data.path '{config.path}' splits into {len(train_files)} training and {len(val_files)} "
                "validation files; both need one at least (match more files or change data.test_fraction)"
            )


def build_datasets(config: DataConfig) -> DatasetSplit:
    """The train/test split named by ``[data] dataset``."""
    check_data(config)
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
