"""The seams at which the trainer meets healing (ringtrain/heal/), and the null object used without it.

The trainer knows nothing of generations, members or the job store: it calls these at its step boundaries
and writes, and healing (``heal.supervisor.Supervisor``) answers. Without ``--heal`` every call is a no-op."""

from __future__ import annotations

from collections.abc import Callable

from ringtrain.group.watch import HEARTBEAT_INTERVAL_S
from ringtrain.monitor.loggers import Logger

__all__ = ["NoHealing"]


class NoHealing:
    """Healing off: a failed collective ends the worker (and the restart path takes over)."""

    beat_s: float = HEARTBEAT_INTERVAL_S
    """How often every rank's heartbeat ticks (the watch compares them a few ticks apart)."""

    @property
    def count(self) -> int:
        """Heals of the whole job so far (summary.json's ``heals``)."""
        return 0

    def begin_step(self) -> None:
        """A step is about to start (healing snapshots what a redone step must find as it was)."""

    def check_fence(self) -> None:
        """Before any write into the run directory: raise if this worker was cut off from the job."""

    def committed(self, step: int) -> None:
        """Step ``step`` is applied and committed on this rank."""

    def at_boundary(self) -> None:
        """Between two steps: may raise to take the trainer out of ``train()`` (a worker joins here)."""

    new_group: Callable[[], object] | None = None
    """How the trainer's side groups (a sharded checkpoint's) are made; None: ``dist.new_group``."""

    def where(self) -> dict[str, int]:
        """This worker's member id and generation, for the test facility's fault plans (nothing: its rank)."""
        return {}

    def members(self) -> list[int] | None:
        """The id each rank's heartbeat beats under (None: its rank)."""
        return None

    def wrap_logger(self, logger: Logger) -> Logger:
        return logger

    def wrap_dump(self, dump: Callable[[str], None] | None) -> Callable[[str], None] | None:
        return dump
