"""TrainState: the loop's position, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Where training stands: committed steps, the epoch, samples consumed, skipped steps.

        state = TrainState()
        state.step += 1; state.samples_seen += window
        checkpoint["train_state"] = state.state_dict()
    """

    step: int = 0
    """Optimizer steps committed so far."""
    epoch: int = 0
    """The epoch being trained (0-based); equals the number of completed epochs."""
    samples_seen: int = 0
    """Training samples consumed by committed steps, over all workers and epochs."""
    skipped_steps: int = 0
    """Steps whose update every rank skipped (a non-finite loss or gradient on some rank)."""
    consecutive_skips: int = 0
    """Skipped steps in a row up to now (0 after a good step)."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
