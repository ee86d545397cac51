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

__all__ = ["ClassificationTask", "LanguageModelTask", "Task", "build_task"]


class ClassificationTask:
    """Cross-entropy training; evaluation reports loss, top-1 and top-5 accuracy."""

    eval_fields = ("loss_sum", "correct", "correct_top5", "count")
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
        """[loss sum, top-1 correct, top-5 correct, samples] of one batch, summed across batches and ranks."""
        loss = F.cross_entropy(outputs.float(), targets, reduction="sum")
        top = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
        hits = top == targets[:, None]
        return torch.stack(
            [
                loss.double(),
                hits[:, 0].sum().double(),
                hits.any(dim=1).sum().double(),
                torch.tensor(len(targets), dtype=torch.float64, device=outputs.device),
            ]
        )

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, correct, correct_top5, count = sums.tolist()
        return {
            "accuracy": correct / count,
            "top5_accuracy": correct_top5 / count,
            "loss": loss_sum / count,
            "count": int(count),
        }


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


def build_task(dataset: str) -> Task:
    """The task for ``[data] dataset``: language modelling for text, classification for the rest."""
    return LanguageModelTask() if dataset == "text" else ClassificationTask()


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else math.inf
