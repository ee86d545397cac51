"""A user's parts for `ringtrain bench train configs/bench_user_resnet18.toml`: torchvision's own resnet18
function is the model factory (named in the config), and this module's synthetic images are the data, as
a user's project would hold them (plain torch, nothing from ringtrain). Run from the repository root, which
is how `bench.user_parts` imports."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class NoisyPatterns(Dataset):
    """Image ``i``: its class's fixed pattern plus noise seeded by ``i``; learnable, nothing stored."""

    def __init__(self, size: int, image_size: int, num_classes: int, offset: int = 0, seed: int = 0):
        self.size, self.offset, self.num_classes = size, offset, num_classes
        self.shape = (3, image_size, image_size)
        self.patterns = torch.randn(num_classes, *self.shape, generator=torch.Generator().manual_seed(seed))
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        index = int(index) + self.offset
        noise = torch.randn(self.shape, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + index))
        label = index % self.num_classes
        return self.patterns[label] + 2.0 * noise, label


def synthetic_images(size: int = 4096, image_size: int = 32, num_classes: int = 10):
    """(train, eval): ``size`` training images and a tenth as many held out."""
    return (NoisyPatterns(size, image_size, num_classes),
            NoisyPatterns(size // 10, image_size, num_classes, offset=size))
