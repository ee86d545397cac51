"""A pipeline's schedule and the micro-batches it runs (``pipeline.py``'s pieces): the schedule classes by
``[parallel] pp_schedule`` name, one built from the stages for a micro-batch count (``make_schedule``; the
schedule does not scale gradients again: the loss is scaled by the step), the micro-batches padded to one shape
(``pad_rows``: rows the loss does not read), and under FSDP2 or zero3 beside the pipeline the data-parallel
ranks' agreement on the step's micro-batch count and shape (``agree_shapes``).

    >>> pad_rows(torch.ones(2, 3), 4).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SCHEDULES", "agree_shapes", "make_schedule", "pad_rows"]

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
"""``[parallel] pp_schedule`` -> the class in ``torch.distributed.pipelining``."""
_SCHEDULES_KEPT = 8
"""Schedules kept built (their stages' shape inference runs once per micro-batch shape and count)."""
_MULTI = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


def make_schedule(name: str, stages: list[Any], count: int, loss_fn: Callable) -> Any:
    """The schedule ``name`` (``SCHEDULES``) over this rank's ``stages`` (torch ``PipelineStage``s: one, or several
    for the multi-stage schedules) for ``count`` micro-batches; ``loss_fn`` is called on the last stage with
    each micro-batch's outputs and targets, and its scale is the step's (``scale_grads=False``)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[name])
    if name in _MULTI:
        return cls(stages, n_microbatches=count, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=count, loss_fn=loss_fn, scale_grads=False)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (a schedule's stages exchange activations of one shape)."""
    if len(x) == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - len(x), *x.shape[1:])])


def agree_shapes(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], rows: int,
                 group: dist.ProcessGroup) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """FSDP2 or zero3 beside the pipeline gather parameters in every stage forward, the schedule's shape
    inference included (a new micro-batch shape or count builds a new schedule): every data-parallel rank of
    ``group`` must run the same forwards. So the ranks agree on the step's micro-batch count, rows and, for
    token ids, width (each rank's share of ragged text is as wide as its own longest sequence): sequences padded
    on the right (tokens 0, targets ignored: the causal model's earlier positions do not see them),
    micro-batches of padding rows added (their loss is 0). Returns the micro-batches and the rows each is padded
    to."""
    from ringtrain.data.text import IGNORE_INDEX

    x0, t0 = micro_batches[0]
    tokens = x0.dim() == 2 and t0.dim() == 2 and not x0.is_floating_point()
    need = torch.tensor([len(micro_batches), rows, x0.shape[1] if tokens else 0], dtype=torch.int64,
                        device=x0.device)
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
    count, rows, width = need.tolist()
    if tokens:
        micro_batches = [(nn.functional.pad(x, (0, width - x.shape[1])),
                          nn.functional.pad(t, (0, width - t.shape[1]), value=IGNORE_INDEX)) for x, t in micro_batches]
    x0, t0 = micro_batches[0]
    return micro_batches + [(x0[:0], t0[:0])] * (count - len(micro_batches)), rows
