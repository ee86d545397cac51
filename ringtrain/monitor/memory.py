"""Memory readings of this process: resident set (psutil), its peak, and CUDA's peak allocation."""

from __future__ import annotations

import resource
import sys

import psutil
import torch

__all__ = ["memory_mb"]

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
