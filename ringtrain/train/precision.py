"""Mixed precision: autocast for the forward pass, and loss scaling for fp16.

    precision = Precision("bf16", torch.device("cpu"))
    with precision.autocast():
        loss = task.loss_sum(model(inputs), targets)
    precision.scale(loss).backward()
    precision.unscale_(optimizer)          # before clipping: clip the true gradient
    precision.step(optimizer)              # skips the step if fp16 gradients overflowed

Weights, gradients and optimizer state stay fp32; autocast runs matmuls and convolutions in the low
precision. bf16 has fp32's exponent range and needs no scaling; fp16 does (a GradScaler), and the
scaler's state is checkpointed so a resumed run keeps its scale.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["Precision"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, kind: str, device: torch.device):
        if kind not in _DTYPES:
            raise ValueError(f"unknown precision {kind!r}; use one of {sorted(_DTYPES)}")
        self.kind = kind
        self.device = device
        self.dtype = _DTYPES[kind]
        self.scaler = torch.amp.GradScaler(device.type) if kind == "fp16" else None

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @property
    def skips_overflow(self) -> bool:
        """fp16's GradScaler skips steps whose gradients overflowed (and lowers its scale) by itself."""
        return self.scaler is not None

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """The step is skipped (a bad loss somewhere): no update, but the scaler must close its step."""
        if self.scaler is not None:
            self.scaler.update()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
