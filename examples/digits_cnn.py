"""A plain PyTorch script, one process: a small CNN on scikit-learn's digits, its own Dataset, AdamW, a cosine
schedule, validation accuracy. examples/digits_cnn_session.py is the same script on ringtrain.Session (diff them:
+9/-6 lines), examples/digits_cnn_fit.py the same training through ringtrain.fit."""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
val_loader = DataLoader(val_set, batch_size=256)

torch.manual_seed(0)
model = SmallCNN()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

for epoch in range(args.epochs):
    model.train()
    for inputs, targets in train_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()

    model.eval()
    correct = 0
    with torch.no_grad():
        for inputs, targets in val_loader:
            correct += (model(inputs).argmax(1) == targets).sum().item()
    print(f"epoch {epoch}: loss {loss.item():.4f}, validation accuracy {correct / len(val_set):.3f}")
