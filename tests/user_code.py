"""A user's project as ringtrain meets it: model and data factories, losses, metrics, a fit() script.

Imported by the tests in-process, named by configs as ``tests.user_code:...``, and run as a script
(``ringtrain run tests/user_code.py``): one file plays every role a user's code plays.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ringtrain.data.digits import load_digits_split
from ringtrain.models import MLP


def say_summary(result: dict) -> None:
    """Print ``SUMMARY {json}`` as one write: every rank prints it into one pipe, and print()'s separate write of
    the newline (stdout is unbuffered under the launcher) lets another rank's line land inside this one."""
    os.write(1, ("SUMMARY " + json.dumps(result) + "\n").encode())


# --- the user's parts -------------------------------------------------------------------------------------


def digits_mlp(hidden: int = 32) -> nn.Module:
    """The built-in digits MLP class, as a user would import it: the oracle of bit-identity."""
    return MLP(64, [hidden, hidden], 10)


def dropout_mlp(hidden: int = 32, p: float = 0.2) -> nn.Module:
    """A digits MLP with dropout after each hidden layer: per-step randomness drawn in the training process."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, 10))


def digits() -> tuple[Dataset, Dataset]:
    split = load_digits_split(0.2, 0)
    return split.train, split.test


def mean_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def sum_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="sum")


def per_sample_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")  # not a scalar: a user error


def accuracy_metrics() -> dict:
    from torchmetrics.classification import MulticlassAccuracy

    return {"macro_accuracy": MulticlassAccuracy(num_classes=10, average="macro")}


class DictInputs(Dataset):
    """Items whose input is a dict ({"pixels": x}): the model is called as model(**input)."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return {"pixels": x}, y


class DictMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = digits_mlp()

    def forward(self, pixels: torch.Tensor):
        return self.mlp(pixels)


class UnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(64, 10)
        self.unused = nn.Linear(64, 10)

    def forward(self, x):
        return self.used(x)


class Stream(IterableDataset):
    def __iter__(self):
        yield from digits()[0]


class Triples(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        return torch.zeros(64), 0, "extra"


# --- factories with mistakes, named by configs in the error tests --------------------------------------------

NOT_CALLABLE = 42


def data_as_list():
    return list(digits())


# --- the script: `ringtrain run tests/user_code.py -- --case NAME` ------------------------------------------

CONFIG = {
    "train": {"epochs": 2, "global_batch_size": 64, "local_batch_size": 16, "lr": 0.1, "lr_schedule": "constant",
              "seed": 0},
    "checkpoint": {"every_steps": 10},
    "monitor": {"log_every_steps": 5, "progress": False},
}


def main() -> None:
    import ringtrain

    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="oracle")
    parser.add_argument("--config", default="{}", help="JSON merged into CONFIG's sections")
    args = parser.parse_args()
    config = {section: dict(values) for section, values in CONFIG.items()}
    for section, values in json.loads(args.config).items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values  # a top-level field: run_dir
    train, test = digits()
    kwargs = {}
    model = digits_mlp
    if args.case == "dict_inputs":
        train, test, model = DictInputs(train), DictInputs(test), DictMLP
    elif args.case == "mean_loss":
        kwargs = {"loss": mean_cross_entropy, "metrics": accuracy_metrics()}
    elif args.case == "sum_loss":
        kwargs = {"loss": sum_cross_entropy, "loss_reduction": "sum"}
    elif args.case == "non_scalar_loss":
        kwargs = {"loss": per_sample_loss}
    elif args.case == "unused_parameter":
        model = UnusedLayer
    elif args.case == "iterable":
        train = Stream()
    elif args.case == "triples":
        train = Triples()
    case = FRONT_DOOR.get(args.case)
    if case is not None:
        case(config, train, test)
        return
    summary = ringtrain.fit(model=model, train_data=train, eval_data=test, config=config, **kwargs)
    say_summary({k: summary[k] for k in ("steps", "eval", "param_sha256")})


# --- the front door's cases (tests/fit/test_front_door.py): what a new user's script does ----------------------


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def model_digest(model: nn.Module) -> str:
    from ringtrain.train.guards import check_replicas

    return check_replicas(model, 0)[0]  # after fit(): no group, this process's own digest


def lengths_differ(config, train, test):
    """Every rank loads 'its' dataset: rank R gets 256 + R samples (a per-rank split gone wrong)."""
    import os

    import ringtrain
    from torch.utils.data import Subset

    mine = 256 + int(os.environ.get("RANK", "0"))
    ringtrain.fit(model=digits_mlp, train_data=Subset(train, range(mine)), eval_data=test, config=config)


def wrong_keys(config, train, test):
    """Dict inputs {"pixel": x} for a forward(pixels)."""
    import ringtrain

    class Renamed(DictInputs):
        def __getitem__(self, index):
            x, y = self.base[index]
            return {"pixel": x}, y

    ringtrain.fit(model=DictMLP, train_data=Renamed(train), eval_data=Renamed(test), config=config)


def metric_misfit(config, train, test):
    """A binary metric on 10-class logits: it fails in torchmetrics' update."""
    import ringtrain
    from torchmetrics.classification import BinaryAccuracy

    ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config,
                  metrics={"binary_acc": BinaryAccuracy()})


def metric_inputs(config, train, test):
    """The fix: the same metric given what it needs (class 0 against the rest)."""
    import ringtrain
    from torchmetrics.classification import BinaryAccuracy

    result = ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config,
                           metrics={"zero_acc": (BinaryAccuracy(), lambda outputs, targets: (
                               outputs.argmax(-1) == 0, (targets == 0).long()))})
    say_summary(result["eval"])


def raises_on_rank_1(config, train, test):
    """A wrong dict key in the loss, on rank 1 only, at its first training step."""
    import ringtrain

    calls = []

    def loss(outputs, targets):
        calls.append(1)
        if rank() == 1 and len(calls) > 1:  # call 1: the check of one eval batch before step 1
            return {"logits": outputs}["logit"]
        return F.cross_entropy(outputs, targets)

    ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config, loss=loss)


def pretrain_then_fine_tune(config, train, test):
    """fit() twice in one script, the second on the module the first trained; one run directory named (the
    default, or --run-dir): the second call gets its own."""
    import ringtrain

    model = digits_mlp()
    first = ringtrain.fit(model=model, train_data=train, eval_data=test, config=config)
    second = ringtrain.fit(model=first.model, train_data=train, eval_data=test,
                           config={**config, "train": {**config["train"], "lr": 0.01}})
    say_summary({"first": first["param_sha256"][0], "second": second["param_sha256"][0],
                 "same_module": second.model is model, "restarts": second["restarts"],
                 "model": model_digest(second.model)})


def own_optimizer(config, train, test):
    """The user's AdamW, and the default schedule (no lr_scheduler)."""
    import ringtrain

    result = ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config,
                           optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01))
    say_summary({"param_sha256": result["param_sha256"], "model": model_digest(result.model)})


def halve_every_5(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def own_scheduler(config, train, test):
    """The user's scheduler: StepLR computes each lr from the last (a resume must step it to the step)."""
    import ringtrain

    result = ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config,
                           lr_scheduler=halve_every_5)
    say_summary({"param_sha256": result["param_sha256"]})


def fit_arguments(config, train, test):
    """Resume and run directory as fit() arguments (under python or torchrun there are no flags)."""
    import os

    import ringtrain

    resume = os.environ.get("USER_RESUME", "")
    result = ringtrain.fit(model=digits_mlp, train_data=train, eval_data=test, config=config,
                           run_dir=os.environ["USER_RUN_DIR"], resume=resume == "true" or resume)
    say_summary({"steps": result["steps"], "param_sha256": result["param_sha256"]})


FRONT_DOOR = {f.__name__: f for f in (lengths_differ, wrong_keys, metric_misfit, metric_inputs, raises_on_rank_1,
                                      pretrain_then_fine_tune, own_optimizer, own_scheduler, fit_arguments)}


if __name__ == "__main__":
    main()


# --- variable-length sequences for token budgets (the gradient tests) ------------------------------------------


class Sequences(Dataset):
    """Token sequences of 3 to 20 tokens: (ids[:-1], ids[1:]) as 1-D tensors of different lengths."""

    def __init__(self, count: int = 64, vocab: int = 11, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 22, (count,), generator=g)
        self.items = [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        ids = self.items[index]
        return ids[:-1], ids[1:]


def pad_sequences(items):
    """The user's collate: inputs padded with 0, targets with -100 (what train.max_tokens reads lengths from)."""
    width = max(len(x) for x, _ in items)
    inputs = torch.zeros(len(items), width, dtype=torch.long)
    targets = torch.full((len(items), width), -100, dtype=torch.long)
    for row, (x, y) in enumerate(items):
        inputs[row, : len(x)], targets[row, : len(y)] = x, y
    return inputs, targets


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def token_sum_loss(outputs, targets):
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
