"""A model input may be a tensor, a tuple of tensors, or a dict of tensors (Hugging Face's ``model(**x)``).

These helpers treat all three alike: every tensor leaf is cut, moved or trimmed along its first (row) axis,
so the loop's micro-batching, device moves and token budgets work on any of them::

    rows(inputs)                      # samples in the batch
    split(inputs, 3)                  # 3 near-equal micro-batches
    take(inputs, index)               # the rows ``index`` (a tensor of positions)
    to_device(inputs, device)
    call_model(model, inputs)         # model(x), model(*x) or model(**x)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Inputs", "rows", "split", "take", "map_tensors", "to_device", "trim", "call_model", "logits_of", "describe"]

Inputs = Any
"""A tensor, a tuple/list of tensors, or a dict of tensors, each with the samples along dimension 0."""


def map_tensors(inputs: Inputs, fn: Callable[[torch.Tensor], Any]) -> Inputs:
    """``fn`` applied to every tensor leaf; the container's kind and keys kept."""
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    if isinstance(inputs, Mapping):
        return {key: map_tensors(value, fn) for key, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(map_tensors(value, fn) for value in inputs)
    return inputs  # a non-tensor leaf (a flag, a string) passes through unchanged


def _first_tensor(inputs: Inputs) -> torch.Tensor | None:
    if isinstance(inputs, torch.Tensor):
        return inputs
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def rows(inputs: Inputs) -> int:
    """Samples in a batch: the length of its first tensor's first dimension."""
    first = _first_tensor(inputs)
    return 0 if first is None or first.dim() == 0 else first.shape[0]


def split(inputs: Inputs, count: int) -> list[Inputs]:
    """``count`` near-equal pieces along the rows (torch.tensor_split's cut); some empty if rows < count."""
    # torch.tensor_split's cut: the larger pieces first.
    base, extra = divmod(rows(inputs), count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [map_tensors(inputs, lambda t, lo=lo, hi=hi: t[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def take(inputs: Inputs, index: torch.Tensor) -> Inputs:
    return map_tensors(inputs, lambda t: t[index])


def trim(inputs: Inputs, width: int, full_width: int) -> Inputs:
    """Cut every leaf whose second dimension is the padded sequence length ``full_width`` to ``width``."""
    return map_tensors(inputs, lambda t: t[:, :width] if t.dim() >= 2 and t.shape[1] == full_width else t)


def to_device(inputs: Inputs, device: torch.device, non_blocking: bool = False) -> Inputs:
    return map_tensors(inputs, lambda t: t.to(device, non_blocking=non_blocking))


def call_model(model: nn.Module, inputs: Inputs) -> Any:
    """The forward pass: ``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def logits_of(outputs: Any) -> torch.Tensor:
    """The tensor a loss reads from a model's outputs: the tensor itself, ``.logits`` (Hugging Face's
    ModelOutput), a dict's ``"logits"``, or a tuple's first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(
        f"the model returned {describe(outputs)}; return a tensor or an object with a .logits tensor"
    )


def describe(value: Any) -> str:
    """A short description of a dataset item's part, for error messages: 'tensor[3, 32]', 'dict(input_ids)'."""
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    if isinstance(value, Mapping):
        return f"dict({', '.join(map(str, value))})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
