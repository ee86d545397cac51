"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, no download.

A fixed stratified split keeps train and test apart and every class in proportion.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from ringtrain.data.split import DatasetSplit

__all__ = ["load_digits_split"]

_PIXEL_MAX = 16.0  # the digits pixels are counts 0..16


def load_digits_split(test_fraction: float, split_seed: int) -> DatasetSplit:
    """Flattened 64-pixel images scaled to [0, 1], and labels 0..9."""
    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=split_seed, stratify=labels
    )

    def to_dataset(x, y) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(x / _PIXEL_MAX, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
        )

    return DatasetSplit(
        train=to_dataset(train_x, train_y),
        test=to_dataset(test_x, test_y),
        num_classes=10,
        input_shape=(images.shape[1],),
    )
