"""The outer loop a strategy may run over its inner optimizer steps (DiLoCo, ``diloco.py``): when it syncs, what it
does at the run's end, after a failed group and in a heal's new one, and which weights an evaluation scores.

Every strategy answers ``strategy.outer_loop``: DiLoCo its own, every other strategy ``NO_OUTER_LOOP`` (a null
object: its ranks are in step after every optimizer step, so there is nothing to do). Callers ask it, never the
strategy's class or name:

    if strategy.outer_loop.sync_due(step, last):   # after every committed step
        strategy.outer_loop.outer_step(step, last)
    with strategy.outer_loop.evaluation_weights():  # DiLoCo: the global model, not this worker's own
        ...evaluate...

A leaf beside ``base.py``: torch's types only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

__all__ = ["OuterLoop", "NoOuterLoop", "NO_OUTER_LOOP"]


class OuterLoop(Protocol):
    """The outer loop's hooks (``NoOuterLoop`` documents each)."""

    syncs_replicas: bool

    def attach(self, module: torch.nn.Module, params: list[torch.Tensor], group: Any) -> None: ...

    def stateful_parts(self) -> dict[str, Any]: ...

    def figures(self) -> dict[str, Any]: ...

    def sync_due(self, step: int, last: bool = False) -> bool: ...

    def outer_step(self, step: int | None = None, last: bool = False) -> None: ...

    def evaluation_weights(self) -> AbstractContextManager: ...

    def end_of_run(self) -> None: ...

    def abandon_interval(self) -> int | None: ...

    def transfer_parts(self) -> dict[str, Any]: ...

    def take_over(self, old: OuterLoop, optimizer: torch.optim.Optimizer,
                  received: dict[str, Any] | None = None) -> None: ...


class NoOuterLoop:
    """The outer loop of a strategy whose ranks are in step after every optimizer step: nothing to do."""

    syncs_replicas = False
    """The outer loop, not a gradient average, keeps a split model's data-parallel replicas together (DiLoCo beside
    tp or pp: their strategy averages nothing over dp)."""

    def attach(self, module: torch.nn.Module, params: list[torch.Tensor], group: Any) -> None:
        """A split model's strategy hands its outer loop what it made: ``module``, this rank's parameters of the
        model and its data-parallel ``group`` (DiLoCo beside tp or pp)."""

    def stateful_parts(self) -> dict[str, Any]:
        """The outer loop's checkpoint parts (DiLoCo's outer state): ``{name: Stateful}``."""
        return {}

    def figures(self) -> dict[str, Any]:
        """The outer loop's figures for records and the summary (DiLoCo's outer steps and bytes)."""
        return {}

    def sync_due(self, step: int, last: bool = False) -> bool:
        """Whether an outer step follows optimizer step ``step`` (``last``: the run's last step)."""
        return False

    def outer_step(self, step: int | None = None, last: bool = False) -> None:
        """The periodic synchronisation after optimizer step ``step``."""

    def evaluation_weights(self) -> AbstractContextManager:
        """The weights an evaluation scores: the module's own (DiLoCo: the global model inside the block)."""
        return nullcontext()

    def end_of_run(self) -> None:
        """The run ends after the last committed step (DiLoCo's workers take one model)."""

    def abandon_interval(self) -> int | None:
        """The group failed: the inner steps dropped going back to the last outer step's model (DiLoCo); None."""
        return None

    def transfer_parts(self) -> dict[str, Any]:
        """What a heal's transfer carries beyond the trainer's parts (DiLoCo: its outer state)."""
        return {}

    def take_over(self, old: OuterLoop, optimizer: torch.optim.Optimizer,
                  received: dict[str, Any] | None = None) -> None:
        """After a heal's regroup: go on from ``old`` (the failed group's outer loop) or from the state ``received``
        in the transfer."""


NO_OUTER_LOOP = NoOuterLoop()
