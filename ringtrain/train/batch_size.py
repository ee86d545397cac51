"""Micro-batching: how a rank cuts its share of a step, and shrinking it together when memory runs out.

A step's share is cut either into ``ceil(largest share / micro_batch_size)`` near-equal micro-batches
(the same count on every rank, computed without talking), or, for variable-length text, into
micro-batches of whole sequences filled up to ``max_tokens``. Token counts differ between ranks, so a
text step starts with one small all-reduce that gives every rank the step's global token count (each
token's loss is divided by it, so gradients equal the full batch's however tokens fall) and the largest
micro-batch count (ranks with fewer micro-batches run empty ones first, so all run alike).

With ``auto_micro_batch`` a step can be redone. An out-of-memory error (a CUDA OOM, the resident set
above ``memory_budget_mb``, or one a test's fault plan raises at the point ``step.micro_batch``) on any
rank makes *every* rank drop the attempt's gradients, halve ``micro_batch_size`` (and ``max_tokens``)
and run the step again with twice the accumulation: the global batch and the samples in it do not change. The ranks learn of each
other's failure from one all-reduce after the micro-batches (``failed_ranks``); nothing before it may be
a collective, or a rank that stopped early would leave the others waiting in one. The loop arranges
that (see ``Trainer._forward_backward``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.comm.objects import all_gather_json
from ringtrain.config import TrainConfig
from ringtrain.data.loader import StepBatch
from ringtrain.data.sampler import grad_accum_steps_for_window
from ringtrain.errors import RingtrainError
from ringtrain.testing import faults
from ringtrain.train.tasks import Task

__all__ = ["OUT_OF_MEMORY", "MemoryBudgetExceeded", "MicroBatcher", "StepPlan", "BufferSnapshot"]


class MemoryBudgetExceeded(RuntimeError):
    """The worker's resident memory went above ``train.memory_budget_mb``."""


OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryBudgetExceeded)
"""The errors a recoverable step survives by shrinking its micro-batch."""


@dataclass
class StepPlan:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    """This rank's (inputs, targets) micro-batches; some may be empty."""
    global_items: int
    """Loss items (samples, or target tokens) of the whole window over all ranks: each item's loss is
    divided by this, so the summed gradient is the window's mean."""


class MicroBatcher:
    """Plans each step's micro-batches; checks memory; shrinks the micro-batch when some rank ran out."""

    def __init__(self, train: TrainConfig, task: Task, rank: int, world_size: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, count: int | None = None, count_multiple: int = 1):
        """``rank`` and ``world_size`` in the data-parallel dimension (``group``: its ranks; None, the whole
        group): under tensor and pipeline parallelism the ranks of one model's group cut the same samples
        alike. ``count``: cut every step into exactly this many micro-batches of one shape (a pipeline's);
        with ``max_tokens`` too, into as many as the token budget needs, at least ``count`` and a multiple of
        ``count_multiple`` (see ``pipeline_count``)."""
        self.count = count
        self.count_multiple = count_multiple
        self.micro_batch_size = train.local_batch_size
        self.max_tokens = train.max_tokens
        self.recoverable = train.auto_micro_batch
        self.task = task
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = device
        self.memory_budget_bytes = None if train.memory_budget_mb is None else int(train.memory_budget_mb * 2**20)
        self.shrinks = 0
        self._process = psutil.Process()

    # --- planning --------------------------------------------------------------------------------------
    def plan(self, batch: StepBatch, window: int) -> StepPlan:
        """This rank's micro-batches of the step whose window holds ``window`` samples."""
        if self.count is not None:
            micro = batch.micro_batches(self.pipeline_count(batch))
        elif self.max_tokens is not None:
            micro = batch.token_micro_batches(self.max_tokens, self.micro_batch_size)
        else:
            # The same count on every rank, from the window: a rank with a smaller share (the window need not
            # divide by the world size) runs smaller micro-batches, possibly of 0 rows.
            micro = batch.micro_batches(grad_accum_steps_for_window(window, self.world_size, self.micro_batch_size))
        if self.task.items_are_samples:
            return StepPlan(micro, window)
        # One small all-reduce: slot 0 sums the step's items, slot 1 + r holds rank r's micro-batch count.
        counts = torch.zeros(1 + self.world_size, dtype=torch.int64, device=self.device)
        counts[0] = self.task.count_items(batch.targets)
        counts[1 + self.rank] = len(micro)
        dist.all_reduce(counts, group=self.group)
        busiest = int(counts[1:].max())
        if self.count is not None and busiest > len(micro):
            # A pipeline's micro-batches share one shape, and FSDP2 over its replicas gathers each stage once per
            # micro-batch: every replica runs the busiest one's count, its own share cut that much finer.
            return StepPlan(batch.micro_batches(busiest), int(counts[0]))
        # Empty micro-batches go first, so the last one (the one that synchronises) has data if any.
        return StepPlan([batch.empty()] * (busiest - len(micro)) + micro, int(counts[0]))

    def pipeline_count(self, batch: StepBatch) -> int:
        """How many micro-batches a pipeline cuts this rank's share into: ``count`` (``pp_microbatches``), or
        with a token budget as many as keep each at most ``max_tokens`` padded tokens, every one as wide as the
        share's longest sequence (a schedule's stages exchange activations of one shape), at least ``count``
        and a multiple of ``count_multiple`` (the interleaved schedules run rounds of pp). A sequence longer
        than the budget is a micro-batch alone. For example 30 sequences padded to 128 tokens under
        ``max_tokens = 1024`` are 4 micro-batches (8, 8, 7 and 7 sequences), at pp = 2 with 1F1B.
        """
        if self.max_tokens is None:
            return self.count
        rows = max(1, self.max_tokens // batch.targets.shape[1])
        count = max(self.count, -(-len(batch) // rows))
        return -(-count // self.count_multiple) * self.count_multiple

    # --- memory -----------------------------------------------------------------------------------------
    def after_forward(self, step: int, is_last: bool) -> None:
        """Called where memory peaks (activations held) in ``step`` (counted from 1). Raises like an
        out-of-memory would."""
        faults.point("step.micro_batch")  # a test's fault plan raises torch.OutOfMemoryError here
        self.check_budget()

    def check_budget(self) -> None:
        """Raise MemoryBudgetExceeded if the resident set is above the budget (called after each backward too)."""
        if self.memory_budget_bytes is None:
            return
        rss = self._process.memory_info().rss
        if rss > self.memory_budget_bytes:
            raise MemoryBudgetExceeded(
                f"resident memory {rss / 2**20:.0f} MB is above train.memory_budget_mb "
                f"({self.memory_budget_bytes / 2**20:.0f})"
            )

    def failed_ranks(self, error: str | None) -> dict[int, str]:
        """After an attempt, every rank learns which ranks ran out of memory (empty: every rank fit).

        The decision is one all-reduce of a flag per rank; only after a failure are the messages gathered
        too, so the log can say what happened where.
        """
        # Every rank of the job, whatever its place in the model: a rank of a tensor-parallel group that ran out
        # leaves its peers waiting in the next collective unless all of them redo the step.
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=self.device)
        flags[dist.get_rank()] = error is not None
        dist.all_reduce(flags)
        if not flags.any():
            return {}
        messages = all_gather_json(error)
        return {rank: messages[rank] for rank, flag in enumerate(flags.tolist()) if flag}

    def shrink(self, step: int, failed: dict[int, str]) -> dict[str, Any]:
        """Halve the micro-batch (every rank alike: they all saw the same ``failed``); a metrics record."""
        if self.micro_batch_size <= 1:
            raise RingtrainError(
                f"out of memory at step {step} with one sample per micro-batch ({_describe(failed)}); "
                "use a smaller model or shorter sequences, or raise train.memory_budget_mb"
            )
        self.micro_batch_size //= 2
        if self.max_tokens is not None:
            self.max_tokens = max(1, self.max_tokens // 2)
        self.shrinks += 1
        release_freed_memory(self.device)
        return {
            "type": "micro_batch",
            "step": step,
            "failed_ranks": sorted(failed),
            "reason": _describe(failed),
            "micro_batch_size": self.micro_batch_size,
            "max_tokens": self.max_tokens,
        }

    # --- what a checkpoint holds: a resumed run keeps the size it shrank to -----------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens, "shrinks": self.shrinks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = int(state["micro_batch_size"])
        self.max_tokens = None if state["max_tokens"] is None else int(state["max_tokens"])
        self.shrinks = int(state["shrinks"])


class BufferSnapshot:
    """Module buffers (BatchNorm's running statistics) as they were before a step's first attempt:
    a failed attempt's forwards have updated them, and the redone step must not count those twice."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.saved = [buffer.detach().clone() for buffer in module.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), self.saved):
                buffer.copy_(saved)


def _describe(failed: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items()))


def release_freed_memory(device: torch.device) -> None:
    """Hand memory freed by the failed attempt back, so the retry's measurements see its own footprint."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _LIBC is not None:
        # glibc keeps freed heap pages; the resident set (what the budget measures) would not drop.
        _LIBC.malloc_trim(0)


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()
