"""A Hugging Face-style model given `labels` computes its own loss: ringtrain says once that it ignores it, or
trains on it with `loss="model"`. Real trainers (the one `fit` builds) on 2 Gloo workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from transformers.modeling_outputs import SequenceClassifierOutput

from ringtrain.config import load_config_dict
from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext
from ringtrain.train.build import build_trainer
from ringtrain.train.user_parts import UserParts
from tests.distributed import run_distributed
from tests import user_code
from tests.trainers import flat_params

STEPS = 6


class LabelledClassifier(nn.Module):
    """The Hugging Face convention: forward(pixels, labels=None) -> ModelOutput, with its own loss as ``.loss``
    when labels are given: the batch's mean cross-entropy with label smoothing (so that training on it differs
    from training on plain cross-entropy)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.linear(pixels)
        loss = None if labels is None else smoothed_cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def smoothed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, label_smoothing=0.1)


def smoothed_loss(outputs: SequenceClassifierOutput, targets: torch.Tensor) -> torch.Tensor:
    """The model's own loss written as a user's loss on the targets: the reference for loss='model'."""
    return smoothed_cross_entropy(outputs.logits, targets)


class WithLabels(Dataset):
    """Items ({"pixels": x, "labels": y}, y): labels in the inputs and as the target."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return {"pixels": x, "labels": y}, y


def labelled_digits() -> tuple[Dataset, Dataset]:
    train, test = user_code.digits()
    return WithLabels(train), WithLabels(test)


CONFIG = {"model": {"factory": "tests.fit.test_model_loss:LabelledClassifier"},
          "data": {"factory": "tests.fit.test_model_loss:labelled_digits"},
          "train": {"global_batch_size": 48, "local_batch_size": 8, "max_steps": STEPS, "lr": 0.1, "seed": 0},
          "monitor": {"progress": False, "log_every_steps": 2}}


def train(rank: int, world_size: int, run_dir: str, loss: str):
    ctx = DistContext(DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size),
                      "gloo", torch.device("cpu"), host_rank=rank, host_world_size=world_size)
    named = "tests.fit.test_model_loss:smoothed_loss" if loss == "smoothed" else loss
    config = load_config_dict({**CONFIG, "task": {"loss": named}}, run_dir=run_dir)
    train_data, eval_data = labelled_digits()
    user = UserParts.checked(LabelledClassifier, train_data, eval_data,
                             loss=smoothed_loss if loss == "smoothed" else loss)
    trainer = build_trainer(config, ctx, parts=user)
    trainer.fit()
    return flat_params(trainer.module)


def warnings_in(run_dir: Path) -> list[str]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["message"] for r in records if r["type"] == "warning"]


@pytest.mark.ranks
def test_a_model_loss_is_named_once_as_ignored_or_trained_on_with_loss_model(tmp_path):
    ignored = run_distributed(train, 2, str(tmp_path / "ignored"), "cross_entropy", timeout_s=120)
    used = run_distributed(train, 2, str(tmp_path / "model"), "model", timeout_s=120)
    reference = run_distributed(train, 2, str(tmp_path / "reference"), "smoothed", timeout_s=120)
    # cross_entropy: 6 steps, micro-batches on both ranks and an evaluation all computed the model's loss; one
    # warning (rank 0's logger; rank 1's is the null logger) says it is ignored and how to avoid or use it.
    [warning] = warnings_in(tmp_path / "ignored")
    assert "ignores it, training on loss='cross_entropy'" in warning and "loss='model'" in warning, warning
    assert warnings_in(tmp_path / "model") == []
    # loss='model' trains on outputs.loss, weighted by the micro-batch's samples as a user's mean loss is: the
    # same parameters as that loss written as a callable on the targets, not those of plain cross-entropy.
    used, reference, ignored = (torch.from_numpy(params[0]) for params in (used, reference, ignored))
    assert torch.equal(used, reference)
    assert not torch.allclose(used, ignored, rtol=1e-4, atol=1e-6)
    summary = json.loads((tmp_path / "model" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval"]["loss"] > 0


@pytest.mark.unit
def test_a_config_names_the_models_own_loss():
    """`[task] loss = "model"` through the factory path of `ringtrain train` (no import of a callable)."""
    config = load_config_dict({**CONFIG, "task": {"loss": "model"}}, run_dir="unused")
    parts = UserParts.from_config(config)
    assert parts.task.loss == "model"
