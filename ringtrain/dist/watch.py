"""Failed collectives that say which rank, which operation and which step, never a cryptic Gloo line.

A collective fails in one of two ways: a peer died (Gloo: "Connection reset by peer", at once) or a peer
stopped responding (Gloo: "Timed out waiting 10000ms for recv", after ``[dist] timeout_s``). Neither
message names the rank. So every rank runs a ``Heartbeat`` thread that bumps a counter in the job store
(which outlives the workers) every half second; a thread keeps beating while its rank waits inside a
collective, and stops when the process is killed or stopped (SIGSTOP). When a collective fails,
``CollectiveWatch`` compares the counters a moment apart and names the ranks whose counter stood still:

    with watch.op("all_reduce (DDP gradient sync)", step=37):
        loss.backward()
    # CollectiveFailed: step 37: all_reduce (DDP gradient sync) failed: rank 1 did not respond within 10 s
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ringtrain.comm import flight
from ringtrain.dist.jobstore import NullJobStore
from ringtrain.comm.errors import CollectiveError
from ringtrain.errors import RingtrainError

__all__ = ["CollectiveFailed", "CollectiveWatch", "FLIGHT_DIR", "Heartbeat", "HEARTBEAT_INTERVAL_S", "flight_dumper"]

HEARTBEAT_INTERVAL_S = 0.5

# Words in the errors Gloo and NCCL raise when a peer is gone or silent (torch raises plain RuntimeError),
# and in ringtrain.comm's own (a DDP hook's exception reaches us as a RuntimeError with its text only).
_COMM_WORDS = (
    "gloo", "nccl", "connection", "timed out", "pair closure", "broken pipe", "peer",
    "died while", "did not arrive within", "did not answer within", "lost rank",
)


class CollectiveFailed(RingtrainError):
    """A collective failed because a peer died or stopped responding."""

    exit_code = 1


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the job store until stopped.

    It is also the rank's watchdog: when someone asks for a flight-recorder dump (``request_dump`` on the
    job store: the launcher on SIGUSR1), it calls ``on_dump_request``, from this thread, so that a rank
    whose main thread is stuck inside a collective still answers."""

    def __init__(self, job_store: NullJobStore, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S,
                 on_dump_request: Callable[[str], None] | None = None):
        # Its own connection: the main thread keeps using the other one.
        self.job_store = job_store.clone()
        self.rank = rank
        self.interval_s = interval_s
        self.on_dump_request = on_dump_request
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ringtrain-heartbeat-{rank}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        count = 0
        try:
            answered = self.job_store.dump_requests()  # requests before this attempt are not ours
        except RuntimeError:
            return
        while not self._stopped.is_set():
            count += 1
            try:
                self.job_store.beat(self.rank, count)
                requests = self.job_store.dump_requests() if self.on_dump_request else answered
            except RuntimeError:
                return  # the store is gone: the job is being torn down
            if requests > answered:
                answered = requests
                try:
                    self.on_dump_request("requested")
                except OSError as err:  # a full disk must not stop the heartbeat
                    print(f"ringtrain: rank {self.rank}: flight recorder dump failed: {err}", file=sys.stderr, flush=True)
            self._stopped.wait(self.interval_s)


class CollectiveWatch:
    """Turns a failed collective into one line naming the operation, the step and the silent ranks."""

    def __init__(self, job_store: NullJobStore, rank: int, world_size: int, timeout_s: float,
                 interval_s: float = HEARTBEAT_INTERVAL_S, on_failure: Callable[[str], None] | None = None):
        self.job_store = job_store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_failure = on_failure
        """Called with the failure's line before it is raised (the trainer dumps the flight recorder)."""

    @contextmanager
    def op(self, name: str, step: int) -> Iterator[None]:
        """Run a collective (or code that runs one, such as a DDP backward) under the watch; the flight
        recorder books the collectives inside to ``name`` at ``step``."""
        try:
            with flight.region(name, step):
                yield
        except RuntimeError as err:
            if isinstance(err, RingtrainError) or not is_comm_error(err):
                raise
            message = self.describe(name, step, err)
            if self.on_failure is not None:
                try:
                    self.on_failure(message)
                except OSError:
                    pass  # the failure's own line matters more than the dump
            raise CollectiveFailed(message) from None

    def describe(self, name: str, step: int, err: Exception) -> str:
        text = str(err)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        silent = self.silent_ranks()
        what = f"step {step}: {name} failed"
        if silent:
            ranks = _ranks(silent)
            if timed_out:
                return f"{what}: {ranks} did not respond within {self.timeout_s:g} s (stopped or hung)"
            verb, its = ("is", "its") if len(silent) == 1 else ("are", "their")
            return f"{what}: {ranks} {verb} gone (connection lost; {its} heartbeat stopped)"
        detail = _first_line(text)
        if timed_out:
            return f"{what}: no peer answered within {self.timeout_s:g} s ({detail})"
        return f"{what}: {detail}"

    def silent_ranks(self) -> list[int]:
        """Ranks (other than this one) whose heartbeat did not move over a few beat intervals."""
        try:
            before = self.job_store.beats(self.world_size)
            if not before:
                return []
            time.sleep(2.5 * self.interval_s)
            after = self.job_store.beats(self.world_size)
        except RuntimeError:
            return []  # no store to ask
        return [r for r in range(self.world_size) if r != self.rank and after.get(r) == before.get(r)]


def flight_dumper(run_dir: str | Path, rank: int, world_size: int) -> Callable[[str], None]:
    """Write this rank's flight recorder to RUN_DIR/flight/rank-R.json, with the reason (``ringtrain
    diagnose RUN_DIR`` reads every rank's)."""
    path = Path(run_dir) / FLIGHT_DIR / f"rank-{rank}.json"

    def dump(reason: str) -> None:
        flight.dump(path, reason, rank, world_size, host=socket.gethostname())

    return dump


FLIGHT_DIR = "flight"


def is_comm_error(err: BaseException) -> bool:
    """True for the errors a backend raises when a peer is lost or silent, not for bugs in the model."""
    if isinstance(err, (dist.DistError, CollectiveError)):
        return True
    text = str(err).lower()
    return any(word in text for word in _COMM_WORDS)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    # Gloo prefixes its source location: "[/path/to/pair.cc:545] Read error ...".
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0]
