"""The digits MLP: Linear-ReLU-Linear-ReLU-Linear, Xavier-normal weights, zero biases."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int):
        super().__init__()
        widths = [in_features, *hidden_sizes]
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_normal_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))
