"""What the loop optimises and how it is evaluated, per kind of workload.

The loop asks a task for a *sum* of per-item losses and an item count, never a mean: the mean over a
whole optimizer step (all micro-batches, all ranks) is formed by the loop, so gradients equal those of
the full batch however the items fall across micro-batches and workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ClassificationTask"]


class ClassificationTask:
    """Cross-entropy training; evaluation reports loss and top-1 accuracy."""

    eval_fields = ("loss_sum", "correct", "count")

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, reduction="sum")

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct predictions, samples] of one batch, summed across batches and ranks."""
        loss = F.cross_entropy(outputs.float(), targets, reduction="sum")
        correct = (outputs.argmax(dim=1) == targets).sum()
        return torch.stack([loss.double(), correct.double(), torch.tensor(len(targets), dtype=torch.float64)])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, correct, count = sums.tolist()
        return {"accuracy": correct / count, "loss": loss_sum / count, "count": int(count)}
