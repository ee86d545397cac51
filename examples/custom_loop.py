"""Your own training loop, with every ringtrain guarantee: ``ringtrain.Session`` on scikit-learn's digits.

    torchrun --nproc-per-node 2 examples/custom_loop.py --max-steps 40    # stops after step 40, checkpointed
    torchrun --nproc-per-node 2 examples/custom_loop.py --resume          # goes on from the newest valid one
    ringtrain ledger runs/custom_loop                                      # every sample once per epoch

The loop is yours; the session deals the data exactly once (resumably, mid-epoch), scales and synchronises
the backward so that two micro-batches per rank give the full batch's gradient, commits each step (a
non-finite step skipped on every rank, Ctrl-C saves), and checkpoints. With ``reduction="sum"`` it trains
exactly as ``ringtrain train`` does on the same parts, bit for bit::

    ringtrain train configs/digits_mlp.toml --nproc 2 --set model.factory=examples.custom_loop:build_model \\
        --set data.factory=examples.custom_loop:load_data ...    # tests/fit/test_custom_loop.py
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

import ringtrain


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """1,797 8x8 images bundled with scikit-learn: 80% to train, 20% to test."""
    images, labels = load_digits(return_X_y=True)
    split = train_test_split((images / 16).astype("float32"), labels, test_size=0.2, random_state=0, stratify=labels)
    x_train, x_test, y_train, y_test = map(torch.from_numpy, split)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/custom_loop"))
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this step (0: train every epoch)")
    args = parser.parse_args()
    config = {"train": {"epochs": args.epochs, "max_steps": args.max_steps or None, "global_batch_size": 64,
                        "local_batch_size": 16, "optimizer": "adamw", "lr": 3e-3, "lr_schedule": "constant"},
              "data": {"ledger": True}, "checkpoint": {"every_steps": 10}, "monitor": {"log_every_steps": 1}}
    session = ringtrain.Session(config, run_dir=args.run_dir, resume=args.resume or None)
    train_set, test_set = load_data()
    torch.manual_seed(0)  # as `ringtrain train` seeds a model (rank 0's weights are every rank's anyway)
    # [train]'s optimizer and lr schedule, as `ringtrain train` builds them (local_batch_size 16: 2 micro-batches a
    # rank; a constant lr, so that a run stopped by --max-steps and resumed follows the same plan).
    model, optimizer, scheduler, loader = session.setup(build_model(), data=train_set)
    for epoch in session.epochs():
        for inputs, targets in loader:  # this rank's micro-batches of each step
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets, reduction="sum")
            session.backward(loss, reduction="sum")  # divided by the step's samples: the full batch's gradient
            optimizer.step()  # on a step's last micro-batch: agree, skip non-finite, record, apply, commit
            scheduler.step()
    correct = sum((model(x).argmax(1) == y).sum() for x, y in session.eval_loader(test_set, batch_size=256))
    syncs, steps = session.strategy.comm_timer.syncs, session.state.step - session.start_step
    session.print(f"step {session.state.step} (epoch {session.state.samples_seen / len(train_set):.2f}): test accuracy "
                  f"{session.sum(correct) / len(test_set):.3f} on {len(test_set)} images; {syncs} gradient "
                  f"all-reduces in {steps} steps")
