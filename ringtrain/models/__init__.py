"""Model builders: one architecture per file, chosen by ``[model] name``."""

from __future__ import annotations

import math

from torch import nn

from ringtrain.config import ModelConfig
from ringtrain.data.split import DatasetSplit
from ringtrain.models.mlp import MLP

__all__ = ["MLP", "build_model"]


def build_model(config: ModelConfig, data: DatasetSplit) -> nn.Module:
    """The model named by the config, sized for the data; weights from torch's current RNG state."""
    if config.name == "mlp":
        return MLP(math.prod(data.input_shape), config.hidden_sizes, data.num_classes)
    raise ValueError(f"unknown model {config.name!r}")  # unreachable: the config validates the name
