"""The job store: a few keys that outlive every worker, so a restart can tell what the last attempt did.

Under ``ringtrain train`` it is the rendezvous store the launcher hosts (killing any worker or agent leaves
it up); under plain torchrun it is the agent's shared store. Workers use it for:

- progress: rank 0 records each committed step, so the next attempt can report the steps it lost;
- starts: how many times the worker group has started (restarts = starts - 1);
- heartbeats: every rank's counter, bumped by a background thread (``watch.py``), so a failed collective
  can name the rank that stopped responding, and every rank's host (its address), so it can name the host.

Without such a store (a single process, or torchrun without a shared store) the ``NullJobStore`` answers
"unknown" and nothing is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ringtrain.group.auth import JobSecret
from ringtrain.group.auth_store import AuthStore
from ringtrain.group.env import DistEnv

__all__ = ["JobStore", "NullJobStore", "PreviousAttempt", "connect_job_store"]


@dataclass(frozen=True)
class PreviousAttempt:
    """What the job store knew when this attempt started."""

    starts: int
    """Starts of the worker group so far, this one included (1 on a fresh job)."""
    last_step: int | None
    """The last step the previous attempt committed (None: no previous attempt, or no store)."""
    last_step_time: float | None
    """When it committed it (time.time())."""


class NullJobStore:
    """No store outlives the workers: nothing recorded, nothing known."""

    def begin_attempt(self) -> PreviousAttempt:
        return PreviousAttempt(starts=1, last_step=None, last_step_time=None)

    def record_progress(self, step: int) -> None: ...

    def add_steps_lost(self, steps: int) -> None: ...

    def steps_lost(self) -> int | None:
        """Steps redone after restarts, over the whole job (None: unknown)."""
        return None

    def beat(self, rank: int, count: int) -> None: ...

    def request_dump(self) -> None: ...

    def dump_requests(self) -> int:
        """How many flight-recorder dumps were requested over the job (the watchdog answers new ones)."""
        return 0

    def beats(self, world_size: int) -> dict[int, int]:
        return {}

    def beats_of(self, ids: list[int]) -> dict[int, int]:
        """The heartbeat counters of these ranks (or, under --heal, member ids)."""
        return {}

    def beat_times_of(self, ids: list[int]) -> dict[int, float]:
        """When each of these ranks (member ids) last beat, by its own clock (time.time())."""
        return {}

    def set_host(self, rank: int, address: str) -> None: ...

    def hosts(self, world_size: int) -> dict[int, str]:
        """Each rank's host, as its address (or host id) (ranks that never said are left out)."""
        return {}

    def hosts_of(self, ids: list[int]) -> dict[int, str]:
        """The host of each of these ranks (or, under --heal, member ids)."""
        return {}

    def clone(self) -> NullJobStore:
        return self


class JobStore(NullJobStore):
    """Keys under ``ringtrain/<run id>/`` in a store that outlives the workers; with the job's ``secret`` (every
    ringtrain launch has one) each value sealed with it, and one the job did not write refused (group/auth.py)."""

    def __init__(self, host: str, port: int, prefix: str, is_writer: bool, timeout_s: float = 10.0,
                 secret: JobSecret | None = None):
        self.host, self.port, self.prefix, self.is_writer = host, port, prefix, is_writer
        self.timeout_s, self.secret = timeout_s, secret
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        if secret is not None:
            client = AuthStore(client, secret, where=f"the job store at {host}:{port}")
        self.store = dist.PrefixStore(prefix, client)

    def begin_attempt(self) -> PreviousAttempt:
        """Count this start (writer only) and read what the previous attempt committed."""
        starts = self.store.add("starts", 1 if self.is_writer else 0)
        if not self.store.check(["progress"]):
            return PreviousAttempt(starts, None, None)
        step, when = self.store.get("progress").decode().split()
        return PreviousAttempt(starts, int(step), float(when))

    def record_progress(self, step: int) -> None:
        if self.is_writer:
            self.store.set("progress", f"{step} {time.time()}")

    def add_steps_lost(self, steps: int) -> None:
        if self.is_writer:
            self.store.add("steps_lost", steps)

    def steps_lost(self) -> int | None:
        return self.store.add("steps_lost", 0)

    def beat(self, rank: int, count: int) -> None:
        # The count tells a watcher that the beat moved; the time (the beating host's clock), since when it
        # stands still: a survivor that starts watching after a failure knows at once how long it has.
        self.store.set(f"heartbeat/{rank}", f"{count} {time.time():.3f}")

    def request_dump(self) -> None:
        """Ask every rank to write its flight recorder (its heartbeat thread sees this within a beat)."""
        self.store.add("flight/request", 1)

    def dump_requests(self) -> int:
        return self.store.add("flight/request", 0)

    def beats(self, world_size: int) -> dict[int, int]:
        """Each rank's heartbeat counter (ranks that never beat are left out)."""
        return self.beats_of(list(range(world_size)))

    def beats_of(self, ids: list[int]) -> dict[int, int]:
        return {i: int(count) for i, (count, _) in self._beats(ids).items()}

    def beat_times_of(self, ids: list[int]) -> dict[int, float]:
        return {i: float(when) for i, (_, when) in self._beats(ids).items()}

    def _beats(self, ids: list[int]) -> dict[int, tuple[str, str]]:
        keys = {i: f"heartbeat/{i}" for i in ids}
        return {i: tuple(self.store.get(key).decode().split()) for i, key in keys.items() if self.store.check([key])}

    def set_host(self, rank: int, address: str) -> None:
        self.store.set(f"host/{rank}", address)

    def hosts(self, world_size: int) -> dict[int, str]:
        return self.hosts_of(list(range(world_size)))

    def hosts_of(self, ids: list[int]) -> dict[int, str]:
        keys = {i: f"host/{i}" for i in ids}
        return {i: self.store.get(key).decode() for i, key in keys.items() if self.store.check([key])}

    def clone(self) -> JobStore:
        """A second connection, for another thread (one client socket must not be shared)."""
        return JobStore(self.host, self.port, self.prefix, self.is_writer, self.timeout_s, self.secret)


def connect_job_store(env: DistEnv, is_writer: bool) -> NullJobStore:
    """The job store named by the environment, or the null one when there is none."""
    if not env.job_store:
        return NullJobStore()
    host, _, port = env.job_store.rpartition(":")
    prefix = f"ringtrain/{env.run_id or 'job'}/"
    try:
        return JobStore(host.strip("[]"), int(port), prefix, is_writer, secret=env.job_secret)
    except (RuntimeError, ValueError):
        # The launcher's store is gone (the job is being torn down); training does not need it.
        return NullJobStore()
