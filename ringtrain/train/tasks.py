"""What the loop optimises and how a run is evaluated: one Task for the built-in workloads and a user's own.

The loop asks a task for a *sum* of per-item losses and an item count, never a mean: the mean over a
whole optimizer step (all micro-batches, all ranks) is formed by the loop, so gradients equal those of
the full batch however the items fall across micro-batches and workers. An item is a sample for a
classifier and a target token for a language model (whose sequences have different lengths: averaging
per micro-batch would weight a short sequence's tokens more, the bug transformers #34191 fixed).

A user's loss gives one of two things:

- ``loss_reduction="mean"`` (the default, what ``nn.CrossEntropyLoss()`` returns): the mean over the
  micro-batch's samples; ringtrain multiplies it by the micro-batch's sample count, so the step's gradient
  is the mean over all of its samples however they fall across micro-batches and ranks;
- ``loss_reduction="sum"``: the sum over items (tokens, say); ringtrain divides by the step's global item
  count, counted from the targets before the forward by ``count_items`` (default: the targets' elements that
  are not -100), as the built-in language model does.

Built-ins: ``"cross_entropy"`` (logits [N, C] and class targets [N]: per sample, evaluated with top-1 and,
above 5 classes, top-5 accuracy; logits [N, T, V] and targets [N, T]: per target token, -100 ignored, with
perplexity), ``"mse"`` (per sample: the mean over a sample's elements) and ``"model"``: the loss the model
computed itself, ``outputs.loss`` (a Hugging Face model given ``labels``), taken with ``loss_reduction``
like a user's loss. The built-in workloads train on ``"cross_entropy"`` (``builtin_task``). A model that
computes its own loss while another loss trains wasted that work: one warning says so (``warn``, rank 0's
logger in a run). A micro-batch of 0 rows never reaches the loss (the loop skips it).

    task = build_task("cross_entropy", "mean", None, example_target=train[0][1])
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ringtrain.data.batch import describe, logits_of
from ringtrain.data.text import IGNORE_INDEX  # targets that are not items (padding): cross_entropy's ignore_index
from ringtrain.config.schema import BUILTIN_LOSSES
from ringtrain.errors import ConfigError

__all__ = ["Task", "build_task", "builtin_task", "IGNORE_INDEX", "default_count_items", "model_loss", "top_k_hits",
           "TOP5_MIN_CLASSES"]


TOP5_MIN_CLASSES = 6
"""Top-5 accuracy is reported from 6 classes on: with 5 or fewer every target is in the top 5 (always 100%)."""


LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def default_count_items(targets: torch.Tensor) -> int:
    """Elements of the targets that are not -100."""
    return int((targets != IGNORE_INDEX).sum())


class Task:
    """Loss sums and item counts for the loop; loss (and accuracy for classifiers) for evaluation."""

    def __init__(self, loss: str | LossFn, reduction: str, count_items: Callable[[torch.Tensor], int] | None,
                 token_targets: bool, name: str, metric_inputs: dict[str, Callable] | None = None):
        self.warn: Callable[[str], None] = _python_warning
        """Where the one warning about a model's own loss goes; build_trainer hands rank 0's logger (other
        ranks: the null logger), so it is one line on the console and one record in metrics.jsonl."""
        self._warned_model_loss = False
        self.loss = loss
        self.metric_transforms = dict(metric_inputs or {})
        """Per metric name: ``inputs(outputs, targets) -> (predictions, targets)``, where the user gave one."""
        self.reduction = reduction
        self.name = name
        self.token_targets = token_targets
        """Targets are sequences (one item per target token), not one per sample."""
        self._count = count_items or default_count_items
        self.classifier = loss == "cross_entropy" and not token_targets
        top_k = ("correct", "correct_top5", "count_top5") if self.classifier else ()
        self.eval_fields = ("loss_sum", "count", *top_k)
        self._checked = False

    @property
    def items_are_samples(self) -> bool:
        """Whether a step's item count is its window (no collective needed to know it)."""
        return self.reduction == "mean" and not self.token_targets

    def count_items(self, targets: torch.Tensor) -> int:
        if self.items_are_samples:
            return len(targets)
        return int(self._count(targets))

    def loss_sum(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.loss == "model":
            value = model_loss(outputs)
            if value is None:
                raise ConfigError(f"loss='model' trains on the model's own loss, but the model returned "
                                  f"{describe(outputs)} without a .loss tensor; give it its labels in the inputs "
                                  "(a Hugging Face model computes outputs.loss from inputs['labels']) or choose "
                                  "another loss")
            if not self._checked:
                self._check_scalar(value)
            return value * len(targets) if self.reduction == "mean" else value
        if not self._warned_model_loss and model_loss(outputs) is not None:
            self._warned_model_loss = True
            self.warn(f"the model computed its own loss (outputs.loss: a Hugging Face model does when its inputs "
                      f"hold 'labels') and ringtrain ignores it, training on loss={self.name}; drop 'labels' from "
                      "the inputs to save computing it, or pass loss='model' to train on outputs.loss")
        if self.loss == "cross_entropy":
            return self._cross_entropy_sum(logits_of(outputs), targets)
        if self.loss == "mse":
            predictions = _aligned(logits_of(outputs), targets, "mse")
            per_sample = max(1, targets[0].numel()) if len(targets) else 1
            return F.mse_loss(predictions.float(), targets.float(), reduction="sum") / per_sample
        value = self.loss(outputs, targets)
        if not self._checked:
            self._check_scalar(value)
        return value * len(targets) if self.reduction == "mean" else value

    def _cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.token_targets:
            if logits.dim() != targets.dim() + 1:
                raise ConfigError(f"loss 'cross_entropy' got logits {describe(logits)} for token targets "
                                  f"{describe(targets)}; logits must be [batch, time, vocab] for targets [batch, time]")
            return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return F.cross_entropy(logits, targets, reduction="sum")

    def _check_scalar(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ConfigError(
                f"loss {self.name} returned {describe(value)}, not a scalar; reduce it inside the loss "
                f"(.mean() with loss_reduction='mean', .sum() with 'sum')"
            )
        self._checked = True

    def train_metrics(self, loss: float) -> dict[str, float]:
        return {"ppl": _perplexity(loss)} if self.loss == "cross_entropy" and self.token_targets else {}

    # --- evaluation: sums over batches and ranks, then metrics ------------------------------------------
    def eval_sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_sum(outputs, targets).detach()
        loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).double()  # loss_parallel's: a DTensor
        count = torch.tensor(self.count_items(targets), dtype=torch.float64, device=loss.device)
        sums = [loss, count]
        if self.classifier:
            sums += top_k_hits(logits_of(outputs), targets)
        return torch.stack(sums)

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        values = dict(zip(self.eval_fields, sums.tolist()))
        count = values["count"]
        metrics = {}
        if self.classifier:  # in the built-in task's order: accuracy, top5_accuracy, loss
            metrics["accuracy"] = values["correct"] / count
            if values["count_top5"]:  # more than 5 classes
                metrics["top5_accuracy"] = values["correct_top5"] / values["count_top5"]
        metrics.update(loss=values["loss_sum"] / count if count else math.nan, count=int(count))
        metrics.update(self.train_metrics(metrics["loss"]))
        return metrics

    def metric_inputs(self, outputs: Any, targets: torch.Tensor, name: str | None = None) -> tuple[Any, Any]:
        """(predictions, targets) for the torchmetrics metric ``name``: what its ``inputs`` callable makes of the
        model's outputs, else the logits (shaped like the targets for a regression)."""
        transform = self.metric_transforms.get(name)
        if transform is not None:
            return transform(outputs, targets)
        logits = logits_of(outputs)
        if hasattr(logits, "full_tensor"):  # split by vocabulary (loss_parallel): a metric reads them whole
            logits = logits.full_tensor()
        if self.loss == "mse" and logits.shape != targets.shape and logits.numel() == targets.numel():
            logits = logits.reshape(targets.shape)
        return logits.float(), targets


def build_task(loss: str | LossFn, loss_reduction: str, count_items: Callable | None,
                    example_target: Any, metric_inputs: dict[str, Callable] | None = None) -> Task:
    """The task for a user's loss; ``example_target`` (one dataset item's target) tells per-sample targets
    (a number) from per-token ones (a sequence)."""
    if loss_reduction not in ("mean", "sum"):
        raise ConfigError(f"loss_reduction = {loss_reduction!r}: use 'mean' (the loss averages over samples) or "
                          "'sum' (it sums over items, counted by count_items)")
    if isinstance(loss, str) and loss not in BUILTIN_LOSSES:
        raise ConfigError(f"loss = {loss!r} is not a built-in loss; use 'cross_entropy', 'mse', 'model' (the "
                          "model's own outputs.loss) or a callable loss(outputs, targets) -> scalar")
    if not isinstance(loss, str) and not callable(loss):
        raise ConfigError(f"loss must be 'cross_entropy', 'mse', 'model' or a callable, not {type(loss).__name__}")
    if count_items is not None and loss_reduction != "sum":
        raise ConfigError("count_items goes with loss_reduction='sum'; a 'mean' loss is weighted by its samples")
    if loss in ("cross_entropy", "mse") and loss_reduction == "sum":
        raise ConfigError(f"loss_reduction applies to your own loss callable; the built-in {loss!r} normalises "
                          "itself (per sample, or per token for sequence targets)")
    target = torch.as_tensor(example_target)
    token_targets = loss == "cross_entropy" and target.dim() >= 1
    name = loss if isinstance(loss, str) else getattr(loss, "__qualname__", type(loss).__name__)
    return Task(loss, loss_reduction, count_items, token_targets, repr(name), metric_inputs)


def builtin_task(dataset: str) -> Task:
    """The task of a built-in workload: per-token cross-entropy for ``[data] dataset = "text"`` (the
    language model), per-sample cross-entropy for the rest (the classifiers)."""
    return Task("cross_entropy", "mean", None, token_targets=dataset == "text", name="'cross_entropy'")


def top_k_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-1 hits, top-5 hits, samples scored for top-5) of one batch, as float64 sums. With 5 classes or
    fewer top-5 is not scored (its count is 0): every target would be a hit. The count travels in the sums,
    so the all-reduce tells every rank, also one whose shard of the eval set was empty."""
    scored = logits.shape[1] >= TOP5_MIN_CLASSES
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    hits = top == targets[:, None]
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    correct_top5 = hits.any(dim=1).sum().double() if scored else zero
    count_top5 = torch.tensor(len(targets) if scored else 0, dtype=torch.float64, device=logits.device)
    return hits[:, 0].sum().double(), correct_top5, count_top5


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model computed itself, if it did: ``outputs.loss`` (Hugging Face's ModelOutput, set when the
    inputs hold ``labels``) or a dict's ``"loss"``; None otherwise (a tuple's is not told from its logits)."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def _python_warning(message: str) -> None:
    warnings.warn(f"ringtrain: {message}", stacklevel=3)


def _aligned(predictions: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    if predictions.shape == targets.shape:
        return predictions
    if predictions.numel() == targets.numel():
        return predictions.reshape(targets.shape)  # [N, 1] outputs for [N] targets
    raise ConfigError(f"loss {loss!r}: the model returned {describe(predictions)} for targets {describe(targets)}; "
                      "they must have the same number of elements")


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else math.inf
