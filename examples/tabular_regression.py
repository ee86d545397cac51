"""An MLP regresses scikit-learn's diabetes progression from 10 clinical features, trained by ringtrain.fit.

    ringtrain run examples/tabular_regression.py --nproc 2
    ringtrain run examples/tabular_regression.py --nproc 2 -- --epochs 10   # CI-sized
"""

import argparse
import os

import torch
from sklearn.datasets import load_diabetes
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import R2Score

import ringtrain


def build_mlp(in_features: int = 10, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(in_features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 1),  # [N, 1] predictions for [N] targets: ringtrain lines them up
    )


def standardised(train, test):
    """Both arrays scaled by the train split's mean and deviation (the test split's stay unseen)."""
    mean, std = train.mean(axis=0), train.std(axis=0)
    return [torch.tensor((a - mean) / std, dtype=torch.float32) for a in (train, test)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    features, target = load_diabetes(return_X_y=True)  # 442 patients, bundled with scikit-learn
    train_x, test_x, train_y, test_y = train_test_split(features, target, test_size=0.2, random_state=2)
    train_x, test_x = standardised(train_x, test_x)
    train_y, test_y = standardised(train_y, test_y)  # R² is the same on either scale
    summary = ringtrain.fit(
        model=build_mlp,
        train_data=TensorDataset(train_x, train_y),
        eval_data=TensorDataset(test_x, test_y),
        loss="mse",
        metrics={"r2": R2Score()},
        config={
            "train": {
                "epochs": args.epochs, "global_batch_size": 32, "local_batch_size": 16,
                "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01, "lr_schedule": "constant",
            },
            "monitor": {"eval_every_epochs": 0},
        },
    )
    if int(os.environ.get("RANK", 0)) == 0:
        baseline = LinearRegression().fit(train_x, train_y).score(test_x, test_y)
        print(f"test R² {summary['eval']['r2']:.3f} (least squares on the same split: {baseline:.3f}), "
              f"test MSE {summary['eval']['loss']:.3f} in target variances, {summary['steps']} steps, "
              f"{summary['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
