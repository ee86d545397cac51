"""Reusable receive buffers, so a collective does not allocate (and page-fault) megabytes per call.

A fresh 32 MB ``torch.empty`` on CPU is a fresh ``mmap``: every call would pay thousands of page faults,
milliseconds at the sizes where the ring should be fastest. Buffers are kept per thread (DDP can run comm
hooks on autograd's device threads) and grow to the largest size asked for::

    tmp = scratch(1024, torch.float32, torch.device("cpu"))        # a 1-D view of a cached buffer
"""

from __future__ import annotations

import threading

import torch

__all__ = ["scratch", "release_scratch"]

_local = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements whose contents are undefined; valid until the next call
    with the same ``(dtype, device, slot)`` on this thread."""
    buffers: dict = _local.__dict__.setdefault("buffers", {})
    key = (dtype, device, slot)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
        buffers[key] = buffer
    return buffer[:numel]


def release_scratch() -> None:
    """Free this thread's cached buffers (they are rebuilt on demand)."""
    _local.__dict__.pop("buffers", None)
