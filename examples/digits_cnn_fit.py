"""examples/digits_cnn.py through ringtrain.fit: the same model, Dataset, AdamW and cosine schedule; fit runs the
loop, evaluates every epoch (loss, accuracy) and keeps every guarantee. `ringtrain run THIS --nproc 2` (or
torchrun, or python for one process); `--resume` goes on from the last checkpoint."""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import Dataset

import ringtrain

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()


class Digits(Dataset):
    def __init__(self, images, labels):
        self.images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
        self.labels = torch.tensor(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


images, labels = load_digits(return_X_y=True)
x_train, x_val, y_train, y_val = train_test_split(images, labels, test_size=0.2, random_state=0, stratify=labels)
train_set, val_set = Digits(x_train, y_train), Digits(x_val, y_val)
steps = args.epochs * -(-len(train_set) // 64)

result = ringtrain.fit(
    model=SmallCNN, train_data=train_set, eval_data=val_set, loss="cross_entropy",
    optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01),
    lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps),
    config={"train": {"epochs": args.epochs, "global_batch_size": 64, "local_batch_size": 64}},
)
print(f"validation accuracy {result['eval']['accuracy']:.3f}")
