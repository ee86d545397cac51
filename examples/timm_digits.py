"""A timm ResNet-18 (built untrained, nothing downloaded) classifies scikit-learn's digits, trained by ringtrain.fit.

    ringtrain run examples/timm_digits.py --nproc 2
    ringtrain run examples/timm_digits.py --nproc 2 -- --epochs 3 --image-size 16   # CI-sized
"""

import argparse
import os

import timm
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

import ringtrain


class DigitImages(Dataset):
    """The 8x8 digits upscaled to image_size px, 1 channel, in [-1, 1]; random crops when augment is set."""

    def __init__(self, pixels, labels, image_size: int, augment: bool):
        images = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16  # pixel values are 0..16
        self.images = F.interpolate(images, size=image_size, mode="bilinear") * 2 - 1
        self.labels = torch.tensor(labels)
        # No flips: a mirrored 3 is no digit.
        self.transform = v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), ratio=(0.8, 1.25)) if augment else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    pixels, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(pixels, labels, test_size=0.2, stratify=labels, random_state=0)
    summary = ringtrain.fit(
        model=lambda: timm.create_model("resnet18", pretrained=False, in_chans=1, num_classes=10),
        train_data=DigitImages(train_x, train_y, args.image_size, augment=True),
        eval_data=DigitImages(test_x, test_y, args.image_size, augment=False),
        loss="cross_entropy",
        # ringtrain reports accuracy for a classifier; torchmetrics adds the mean of the per-class accuracies.
        metrics={"balanced_accuracy": MulticlassAccuracy(num_classes=10, average="macro")},
        config={
            "train": {
                "epochs": args.epochs, "global_batch_size": 64, "local_batch_size": 32,
                "optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.05, "warmup_steps": 10,
            },
            "monitor": {"eval_every_epochs": 0},
        },
    )
    if int(os.environ.get("RANK", 0)) == 0:
        scores = summary["eval"]
        print(f"test accuracy {scores['accuracy']:.1%} (balanced {scores['balanced_accuracy']:.1%}) on "
              f"{len(test_y)} images after {summary['steps']} steps, {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
