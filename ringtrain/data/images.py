"""Image datasets for the ResNets, each with torchvision's transforms (v2).

- ``digits_images``: scikit-learn's digits (the embedded default, no download), upscaled once from 8x8
  to ``image_size`` px, one channel.
- ``imagefolder``: the ImageNet layout, ``PATH/train/<class>/*.jpg`` and ``PATH/val/<class>/*.jpg``.
- ``synthetic_images``: images made from their index (class pattern + noise), for benchmarks that must
  not wait on decoding; learnable, so a benchmark's loss still falls.

Training: RandomResizedCrop, optional horizontal flip, normalise. Evaluation: resize to
``image_size / eval_crop_fraction``, centre crop ``image_size``, normalise (the classic 256 -> 224).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from ringtrain.config import DataConfig
from ringtrain.data.digits import load_digits_split
from ringtrain.data.split import DatasetSplit

__all__ = ["load_digits_images", "load_image_folder", "load_synthetic_images", "train_transform", "eval_transform"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(config: DataConfig, mean, std, from_pil: bool = False) -> v2.Compose:
    steps = [v2.ToImage()] if from_pil else []
    steps.append(v2.RandomResizedCrop(config.image_size, scale=(config.crop_scale_min, 1.0), antialias=True))
    if config.hflip:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def eval_transform(config: DataConfig, mean, std, from_pil: bool = False) -> v2.Compose:
    steps = [v2.ToImage()] if from_pil else []
    steps += [
        v2.Resize(round(config.image_size / config.eval_crop_fraction), antialias=True),
        v2.CenterCrop(config.image_size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ]
    return v2.Compose(steps)


class Transformed(Dataset):
    """(transform(image), label) over a dataset of (image, label)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform):
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), self.labels[index]


def load_digits_images(config: DataConfig) -> DatasetSplit:
    """The digits as 1 x image_size x image_size images in [0, 1] (same fixed split as the 8x8 vectors)."""
    vectors = load_digits_split(config.test_fraction, config.split_seed)

    def upscale(dataset) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = dataset.tensors
        small = images.view(-1, 1, 8, 8)
        return F.interpolate(small, size=config.image_size, mode="bilinear", antialias=True).clamp(0, 1), labels

    train_x, train_y = upscale(vectors.train)
    test_x, test_y = upscale(vectors.test)
    mean, std = (train_x.mean().item(),), (train_x.std().item(),)
    return DatasetSplit(
        train=Transformed(train_x, train_y, train_transform(config, mean, std)),
        test=Transformed(test_x, test_y, eval_transform(config, mean, std)),
        num_classes=10,
        input_shape=(1, config.image_size, config.image_size),
    )


def load_image_folder(config: DataConfig) -> DatasetSplit:
    """``PATH/train`` and ``PATH/val`` as torchvision ImageFolders (RGB, ImageNet normalisation)."""
    root = Path(config.path)
    train = ImageFolder(root / "train", transform=train_transform(config, IMAGENET_MEAN, IMAGENET_STD, from_pil=True))
    test = ImageFolder(root / "val", transform=eval_transform(config, IMAGENET_MEAN, IMAGENET_STD, from_pil=True))
    if train.classes != test.classes:
        missing = sorted(set(train.classes) ^ set(test.classes))
        raise ValueError(f"{root}/train and {root}/val hold different classes (only in one: {missing[:5]})")
    return DatasetSplit(
        train=train, test=test, num_classes=len(train.classes), input_shape=(3, config.image_size, config.image_size)
    )


class SyntheticImages(Dataset):
    """Image ``i`` is its class's fixed pattern plus noise seeded by ``i``: deterministic, nothing stored."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int, offset: int = 0):
        self.size = size
        self.shape = (3, image_size, image_size)
        self.num_classes = num_classes
        self.seed = seed
        self.offset = offset
        patterns = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, *self.shape, generator=patterns)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        index = int(index) + self.offset  # numpy integers too
        noise = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % self.num_classes
        return self.patterns[label] + 2.0 * torch.randn(self.shape, generator=noise), label


def load_synthetic_images(config: DataConfig) -> DatasetSplit:
    test_size = max(1, round(config.synthetic_samples * config.test_fraction))
    args = (config.image_size, config.num_classes, config.split_seed)
    return DatasetSplit(
        train=SyntheticImages(config.synthetic_samples, *args),
        test=SyntheticImages(test_size, *args, offset=config.synthetic_samples),
        num_classes=config.num_classes,
        input_shape=(3, config.image_size, config.image_size),
    )
