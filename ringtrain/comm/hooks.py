"""Every algorithm as a DDP communication hook, plus torch's own compression and PowerSGD hooks.

A DDP hook receives a bucket of gradients and returns a future of the averaged bucket. ringtrain's
algorithms finish before returning (a completed future): shm and the rings are driven by this thread, and on
a CPU worker pinned to one core there is no idle core that an asynchronous version could use.
``fp16``, ``bf16`` and ``powersgd`` are torch's hooks, used as they are, except that on CPU ``powersgd``
waits for each bucket before the backward goes on (``sequential_powersgd_hook``): torch's hook issues its
later all-reduces from the callback of its first, which on Gloo runs on a Gloo thread while the backward
issues the next bucket's, so ranks could issue them in different orders (a collective mismatch)::

    >>> ddp = DistributedDataParallel(model)
    >>> register_comm_hook(ddp, "shm")                  # or "ring", "ring_chunked", "fp16", "powersgd", ...
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ringtrain.comm.api import all_reduce

__all__ = ["HOOK_ALGORITHMS", "TORCH_HOOKS", "AllReduceState", "allreduce_hook", "comm_hook", "register_comm_hook",
           "sequential_powersgd_hook"]

TORCH_HOOKS = ("fp16", "bf16", "powersgd")
"""torch's own hooks (torch.distributed.algorithms.ddp_comm_hooks), selectable by name."""
HOOK_ALGORITHMS = ("torch", "ring", "ring_chunked", "shm", *TORCH_HOOKS)


@dataclass(frozen=True)
class AllReduceState:
    """What ``allreduce_hook`` needs: the group, the algorithm, and its options."""

    algorithm: str
    group: dist.ProcessGroup | None = None
    chunk_kb: int | None = None
    timeout_s: float | None = None


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with ringtrain's ``state.algorithm``; a completed future."""
    buffer = bucket.buffer()
    chunk_kb = state.chunk_kb if state.algorithm == "ring_chunked" else None
    # op="avg" divides before summing, as DDP's default hook does (no fp16 overflow).
    all_reduce(buffer, op="avg", algorithm=state.algorithm, group=state.group, timeout_s=state.timeout_s, chunk_kb=chunk_kb)
    future: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    future.set_result(buffer)
    return future


def sequential_powersgd_hook(state: powerSGD_hook.PowerSGDState,
                             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD hook, waited for on CPU: every collective of a bucket is issued before the next
    bucket's, in the same order on every rank (on CUDA, torch's hook as it is)."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if bucket.buffer().is_cuda:
        return future
    result = future.wait()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(result)
    return done


def comm_hook(
    algorithm: str,
    group: dist.ProcessGroup | None = None,
    chunk_kb: int | None = None,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    timeout_s: float | None = None,
) -> tuple[Any, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook`` that averages with ``algorithm``.

    ``"torch"`` is torch's own ``allreduce_hook`` (the same numbers as DDP's built-in all-reduce).
    ``powersgd_rank`` and ``powersgd_start_iter`` are PowerSGD's ``matrix_approximation_rank`` and
    ``start_powerSGD_iter`` (plain all-reduce before that iteration, as torch recommends).
    """
    if algorithm not in HOOK_ALGORITHMS:
        raise ValueError(f"unknown comm algorithm {algorithm!r}; choose one of {', '.join(HOOK_ALGORITHMS)}")
    if algorithm == "torch":
        return group, default_hooks.allreduce_hook
    if algorithm == "fp16":
        return group, default_hooks.fp16_compress_hook
    if algorithm == "bf16":
        return group, default_hooks.bf16_compress_hook
    if algorithm == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
        )
        return state, sequential_powersgd_hook
    return AllReduceState(algorithm, group, chunk_kb, timeout_s), allreduce_hook


def register_comm_hook(model: DistributedDataParallel, algorithm: str, **options: Any) -> None:
    """Make ``model`` synchronise gradients with ``algorithm``; ``options`` as for ``comm_hook``."""
    model.register_comm_hook(*comm_hook(algorithm, **options))
