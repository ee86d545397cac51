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

Under a sharded strategy (zero1/2/3) each rank unscales only its own gradient shard, so its scaler sees only
that shard's overflow; the trainer's step agreement carries every rank's gradient flag, and
``agree_overflow`` hands the scaler that common answer, so every rank skips (or takes) the step and moves
its scale alike, as every rank does under DDP, where all hold the same gradient.
"""

from __future__ import annotations

import dataclasses
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

    def agree_overflow(self, optimizer: torch.optim.Optimizer, verdict: Any) -> Any:
        """fp16 on gradient shards: make the scaler's overflow the one every rank agreed on (``verdict``, a
        ``guards.Verdict`` whose ``grad_ranks`` are the ranks whose shard overflowed), and return the verdict
        without them: the scaler skips an overflowing step and lowers its scale, as under DDP, rather than the
        guard counting a non-finite step. Call it after ``unscale_`` and the agreement."""
        if self.scaler is None:
            return verdict
        # GradScaler keeps unscale_'s finding per optimizer and device until update(); step() and update()
        # read it from there.
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            flag.fill_(float(bool(verdict.grad_ranks)))
        return dataclasses.replace(verdict, grad_ranks=())

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
