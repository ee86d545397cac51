"""Memory readings of this process: resident set (psutil), its peak, CUDA's peak allocation, and the bytes
autograd keeps for backward (``saved_for_backward``)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch

__all__ = ["SavedBytes", "memory_mb", "saved_for_backward"]

_MB = 1024 * 1024
_PROCESS = psutil.Process()


def memory_mb(device: torch.device) -> dict[str, float]:
    """``memory/rss_mb`` now, ``memory/peak_rss_mb`` since the process started, CUDA peak when on GPU."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_bytes = peak_kb if sys.platform == "darwin" else peak_kb * 1024
    reading = {"memory/rss_mb": _PROCESS.memory_info().rss / _MB, "memory/peak_rss_mb": peak_bytes / _MB}
    if device.type == "cuda":
        reading["memory/cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / _MB
    return reading


class SavedBytes:
    """What ``saved_for_backward`` counted: ``bytes`` (each saved tensor's elements x element size, a view
    counted at its own size), ``tensors`` (how many)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0

    @property
    def mb(self) -> float:
        return self.bytes / _MB


@contextmanager
def saved_for_backward() -> Iterator[SavedBytes]:
    """Count the tensors autograd saves for backward while the block runs (``saved_tensors_hooks``): a
    deterministic measure of activation memory, unlike RSS.

        >>> with saved_for_backward() as saved:
        ...     loss = model(x).sum()
        >>> saved.mb
    """
    counted = SavedBytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        counted.bytes += tensor.numel() * tensor.element_size()
        counted.tensors += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counted
