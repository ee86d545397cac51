"""torchvision's ResNets (18/34/50), with the input channels of the data and an optional small-input stem.

ImageNet's stem (7x7 stride-2 convolution, then a stride-2 max-pool) shrinks a 224 px image to 56 px
before the first block; on a 32 px image it would leave 8 px. The small-input stem (as for CIFAR: one
3x3 stride-1 convolution, no max-pool) keeps 32 px through the first stage.

    model = build_resnet("resnet18", num_classes=10, in_channels=1, small_input_stem=True)
"""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18, resnet34, resnet50
from torchvision.models.resnet import ResNet

__all__ = ["RESNETS", "build_resnet"]

RESNETS = {"resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50}


def build_resnet(name: str, num_classes: int, in_channels: int = 3, small_input_stem: bool = False) -> ResNet:
    """A randomly initialised torchvision ResNet (no pretrained weights: nothing is downloaded)."""
    model = RESNETS[name](weights=None, num_classes=num_classes)
    if small_input_stem:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    # The same initialisation torchvision gives the convolution it replaced.
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model
