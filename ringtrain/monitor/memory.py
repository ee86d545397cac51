"""Memory readings of this process: resident set (psutil), its peak, CUDA's peak allocation, the bytes
autograd keeps for backward (``saved_for_backward``), and the peak of the tensors a block creates and holds at
once (``new_tensor_peak``: activations and the temporaries beside them, on any device)."""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NewTensorPeak", "SavedBytes", "memory_mb", "new_tensor_peak", "saved_for_backward"]

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


class NewTensorPeak(TorchDispatchMode):
    """Counts, op by op, the storages the ops inside it create (an output's storage that none of the op's
    inputs has) until they are freed: ``bytes`` alive now, ``peak`` the most at once. Around forward and
    backward with the gradients already allocated (a second step, ``zero_grad(set_to_none=False)``: backward
    then adds into them in place), that peak is the step's activation memory: what autograd keeps, the
    logits, and the temporaries beside them. A DTensor counts its local shard (every traceable tensor
    subclass its inner tensors); the pipeline's receive buffers and the collectives' outputs count.

    torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) measures the same and sorts it by
    module, but its module hooks fail inside ``torch.distributed.pipelining``'s backward (``autograd.grad``
    on a stage's inputs); this needs no hooks. Not for FSDP2, whose gathered parameters are storages it
    resizes in place: those would count as activations."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.peak = 0
        self._alive: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {st._cdata for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
                  for st in _storages(leaf)}
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            for st in _storages(leaf):
                key = st._cdata
                if key in inputs or key in self._alive:
                    continue
                nbytes = st.nbytes()
                self._alive.add(key)
                weakref.finalize(st, self._free, key, nbytes)
                self.bytes += nbytes
                self.peak = max(self.peak, self.bytes)
        return out


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    from torch.distributed._tools.common_utils import get_untyped_storages

    return list(get_untyped_storages(tensor))


@contextmanager
def new_tensor_peak() -> Iterator[NewTensorPeak]:
    """``NewTensorPeak`` around the block:

        >>> with new_tensor_peak() as tracked:
        ...     loss_fn(model(x), y).backward()
        >>> tracked.peak            # bytes
    """
    with NewTensorPeak() as tracked:
        yield tracked
