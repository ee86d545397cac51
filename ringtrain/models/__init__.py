"""Model builders: one architecture per file, chosen by ``[model] name``."""

from __future__ import annotations

import math

from torch import nn

from ringtrain.config import ModelConfig
from ringtrain.data.split import DatasetSplit
from ringtrain.models.mlp import MLP
from ringtrain.models.transformer import TransformerLM

__all__ = ["MLP", "TransformerLM", "build_model"]


def build_model(config: ModelConfig, data: DatasetSplit) -> nn.Module:
    """The model named by the config, sized for the data; weights from torch's current RNG state."""
    if config.name == "mlp":
        return MLP(math.prod(data.input_shape), config.hidden_sizes, data.num_classes)
    if config.name.startswith("resnet"):
        from ringtrain.models.resnet import build_resnet  # torchvision is imported only for ResNets

        return build_resnet(config.name, data.num_classes, data.input_shape[0], config.small_input_stem)
    if config.name == "transformer":
        return TransformerLM(
            vocab_size=data.num_classes,
            seq_len=data.input_shape[0],
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            d_model=config.d_model,
            dropout=config.dropout,
        )
    raise ValueError(f"unknown model {config.name!r}")  # unreachable: the config validates the name
