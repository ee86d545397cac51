"""Distributed evaluation: each rank scores its shard, one all-reduce adds the sums."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from typing import Any

from ringtrain.data.batch import call_model, take, to_device
from ringtrain.train.tasks import Task

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: DataLoader,
    task: Task,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    metrics: Mapping[str, Any] | None = None,
    collective_forward: bool = False,
    group: dist.ProcessGroup | None = None,
    forward: Callable[[Any], Any] | None = None,
    loss_context: Callable[[], AbstractContextManager] = nullcontext,
) -> dict:
    """Metrics over the whole test set, every sample counted once. ``module`` is the unwrapped model: a DDP
    forward would run collectives, and ranks may hold different numbers of eval batches. ``autocast`` gives
    the training precision's context (the sums themselves are fp64). ``metrics``: torchmetrics objects,
    updated with every batch and computed (synchronised across ranks by torchmetrics) at the end.
    ``collective_forward``: the module's forward runs collectives (zero3/fsdp gather parameters), so every
    rank runs as many forwards as the rank with the most batches, the others on batches of zero rows.
    ``forward``: a pipeline's (``PipelineStrategy.forward``): the outputs on the last stage's rank, None on the
    others, which count nothing; the ranks of one pipeline hold the same batches. ``loss_context``: the
    strategy's (``loss_parallel`` when the logits are split by vocabulary), around each forward and its sums."""
    was_training = module.training
    module.eval()
    metrics = metrics or {}
    for metric in metrics.values():
        metric.reset()
    sums = torch.zeros(len(task.eval_fields), dtype=torch.float64, device=device)
    run = forward if forward is not None else (lambda inputs: call_model(module, inputs))
    for inputs, targets in _equal_counts(loader) if collective_forward else loader:
        if len(targets) == 0:
            if collective_forward:
                run(to_device(inputs, device))
            continue
        targets = targets.to(device)
        with loss_context():
            with autocast():
                outputs = run(to_device(inputs, device))
            if outputs is None:
                continue
            sums += task.eval_sums(outputs, targets).to(device)
            for name, metric in metrics.items():
                metric.update(*task.metric_inputs(outputs, targets, name))
    dist.all_reduce(sums, group=group)  # the data-parallel ranks: a tensor-parallel group scored the same samples
    module.train(was_training)
    results = task.eval_metrics(sums.cpu())
    for name, metric in metrics.items():
        results[name] = _plain(metric.compute())
    return results


def _equal_counts(loader: DataLoader):
    """The loader's batches, then batches of zero rows until every rank has run as many as the busiest."""
    count = torch.tensor([len(loader)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    template = None
    for inputs, targets in loader:
        template = (take(inputs, torch.arange(0)), targets[:0])
        yield inputs, targets
    if template is None and int(count) > len(loader):
        inputs, targets = loader.collate_fn([loader.dataset[0]])
        template = (take(inputs, torch.arange(0)), targets[:0])
    for _ in range(int(count) - len(loader)):
        yield template


def _plain(value: Any) -> Any:
    """A metric's value as JSON can hold it: a number, or a list for a per-class tensor."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Mapping):
        return {key: _plain(v) for key, v in value.items()}
    return value
