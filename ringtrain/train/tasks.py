"""What the loop optimises and how it is evaluated, per kind of workload.

The loop asks a task for a *sum* of per-item losses and an item count, never a mean: the mean over a
whole optimizer step (all micro-batches, all ranks) is formed by the loop, so gradients equal those of
the full batch however the items fall across micro-batches and workers. An item is a sample for a
classifier and a target token for a language model (whose sequences have different lengths: averaging
per micro-batch would weight a short sequence's tokens more, the bug transformers #34191 fixed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ringtrain.data.text import IGNORE_INDEX

__all__ = ["ClassificationTask", "LanguageModelTask", "Task", "build_task", "top_k_hits", "TOP5_MIN_CLASSES"]


TOP5_MIN_CLASSES = 6
"""Top-5 accuracy is reported from 6 classes on: with 5 or fewer every target is in the top 5 (always 100%)."""


class ClassificationTask:
    """Cross-entropy training; evaluation reports loss, top-1 and (with more than 5 classes) top-5 accuracy."""

    eval_fields = ("loss_sum", "correct", "correct_top5", "count_top5", "count")
    items_are_samples = True
    """Each sample is one loss item, so a step's item count is its window: no collective needed."""

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Called under autocast, which runs cross_entropy in fp32 whatever the logits' precision.
        return F.cross_entropy(outputs, targets, reduction="sum")

    def count_items(self, targets: torch.Tensor) -> int:
        return len(targets)

    def train_metrics(self, loss: float) -> dict[str, float]:
        return {}

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[loss sum, top-1 correct, top-5 correct, samples scored for top-5, samples] of one batch, summed
        across batches and ranks."""
        loss = F.cross_entropy(outputs.float(), targets, reduction="sum")
        correct, correct_top5, count_top5 = top_k_hits(outputs, targets)
        count = torch.tensor(len(targets), dtype=torch.float64, device=outputs.device)
        return torch.stack([loss.double(), correct, correct_top5, count_top5, count])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, correct, correct_top5, count_top5, count = sums.tolist()
        metrics = {"accuracy": correct / count}
        if count_top5:
            metrics["top5_accuracy"] = correct_top5 / count_top5
        return {**metrics, "loss": loss_sum / count, "count": int(count)}


class LanguageModelTask:
    """Next-token cross-entropy in nats per token, summed over real (not padding) targets."""

    eval_fields = ("loss_sum", "count")
    items_are_samples = False
    """Sequences differ in length: a step's token count must be summed across ranks."""

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            outputs.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def count_items(self, targets: torch.Tensor) -> int:
        return int((targets != IGNORE_INDEX).sum())

    def train_metrics(self, loss: float) -> dict[str, float]:
        return {"ppl": _perplexity(loss)}

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_sum(outputs, targets)
        count = torch.tensor(self.count_items(targets), dtype=torch.float64, device=outputs.device)
        return torch.stack([loss.double(), count])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, count = sums.tolist()
        loss = loss_sum / count
        return {"loss": loss, "ppl": _perplexity(loss), "count": int(count)}


Task = ClassificationTask | LanguageModelTask


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


def build_task(dataset: str) -> Task:
    """The task for ``[data] dataset``: language modelling for text, classification for the rest."""
    return LanguageModelTask() if dataset == "text" else ClassificationTask()


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else math.inf
