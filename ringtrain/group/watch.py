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

Across hosts every rank also records its host's address in the job store. When every rank of another host
went silent and the host does not answer on the network (a connection attempt neither accepted nor refused
within a second), the line names the host: ``host 198.18.0.2 (rank 1) is unreachable``; when every rank of
another host died but the host answers (all its processes were killed), ``host 198.18.0.2 (rank 1) is gone``.
A rank whose own host lost its link finds the job store unreachable and says that instead; a rank on another
host than the job store's whose store connection was dropped names the rendezvous host:
``the rendezvous host 198.18.0.1 (rank 0) is gone``.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ringtrain.comm import flight
from ringtrain.comm.groups import host_id
from ringtrain.group.env import DistEnv
from ringtrain.group.jobstore import NullJobStore
from ringtrain.comm.errors import CollectiveError
from ringtrain.errors import RingtrainError

__all__ = ["CollectiveFailed", "CollectiveWatch", "FLIGHT_DIR", "Heartbeat", "HEARTBEAT_INTERVAL_S", "flight_dumper",
           "host_answers"]

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
        self.address = host_address()
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
            self.job_store.set_host(self.rank, self.address)
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
                 interval_s: float = HEARTBEAT_INTERVAL_S, on_failure: Callable[[str], None] | None = None,
                 members: Sequence[int] | None = None):
        self.job_store = job_store
        self.members = list(members) if members is not None else list(range(world_size))
        """Whose heartbeat each rank beats under (its rank; under --heal its member id, see heal/membership.py)."""
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_failure = on_failure
        """Called with the failure's line before it is raised (the trainer dumps the flight recorder)."""
        self._known_hosts: dict[int, str] = {}
        """Each rank's host address, read from the job store until every rank has said (a few first ops): a
        failure that takes the store with it (the rendezvous host died) can still name that host's ranks."""

    @contextmanager
    def op(self, name: str, step: int) -> Iterator[None]:
        """Run a collective (or code that runs one, such as a DDP backward) under the watch; the flight
        recorder books the collectives inside to ``name`` at ``step``."""
        if len(self._known_hosts) < self.world_size:
            self._known_hosts = self._hosts() or self._known_hosts
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
        # From a host that lost its link the store's calls may block past their own timeout: bound them.
        silent = _within(self.silent_ranks, 2.5 * self.interval_s + _STORE_WAIT_S, default=None)
        what = f"step {step}: {name} failed"
        if silent is None:
            store_host = getattr(self.job_store, "host", "?")
            store = f"{store_host}:{getattr(self.job_store, 'port', '?')}"
            ranks = sorted(r for r, a in self._known_hosts.items() if a == store_host and r != self.rank)
            of = f" ({_ranks(ranks)})" if ranks else ""
            if self._store_elsewhere() and host_answers(store_host):
                return (f"{what}: the rendezvous host {store_host}{of} is gone: the job store at {store} dropped the "
                        "connection and the host answers on the network (node 0's launcher and its ranks died)")
            return (f"{what}: the job store at {store} does not answer either: this host ({host_address()}) lost its "
                    f"link to the others, or the rendezvous host {store_host}{of} is unreachable (down)")
        lost_host = self.unreachable_host(silent)
        if lost_host is not None:
            address, ranks = lost_host
            return (f"{what}: host {address} ({_ranks(ranks)}) is unreachable: its ranks' heartbeats stopped and it "
                    f"does not answer on the network (its link or the host is down; timeout {self.timeout_s:g} s)")
        dead_host = self.dead_host(silent)
        if dead_host is not None:
            address, ranks = dead_host
            return (f"{what}: host {address} ({_ranks(ranks)}) is gone: every one of its ranks stopped (connection "
                    "lost, heartbeats stopped) while the host answers on the network (its processes died or were killed)")
        if silent:
            ranks = _ranks(silent)
            if timed_out:
                return f"{what}: {ranks} did not respond within {self.timeout_s:g} s (stopped or hung)"
            verb, its = ("is", "its") if len(silent) == 1 else ("are", "their")
            return f"{what}: {ranks} {verb} gone (connection lost; {its} heartbeat stopped)"
        detail = first_line(text)
        if timed_out:
            return f"{what}: no peer answered within {self.timeout_s:g} s ({detail})"
        return f"{what}: {detail}"

    def silent_ranks(self) -> list[int] | None:
        """Ranks (other than this one) whose heartbeat did not move over a few beat intervals; None when the
        job store itself cannot be reached (from a host that lost its link)."""
        try:
            before = self.job_store.beats_of(self.members)
            if not before:
                return []
            time.sleep(2.5 * self.interval_s)
            after = self.job_store.beats_of(self.members)
        except RuntimeError as err:
            # A store that timed out is unreachable. One that dropped the connection is being torn down (nothing
            # to say) when it runs on this host; on another host, that host's launcher is gone.
            if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                return None
            return None if self._store_elsewhere() else []
        return [r for r, m in enumerate(self.members) if r != self.rank and after.get(m) == before.get(m)]

    def unreachable_host(self, silent: list[int]) -> tuple[str, list[int]] | None:
        """(address, ranks) of another host all of whose ranks are silent and that does not answer on the
        network; None if there is none (a single host, or the silent ranks' host is up)."""
        hosts = self._hosts()
        mine = hosts.get(self.rank)
        for address in dict.fromkeys(hosts[r] for r in silent if r in hosts):
            ranks = sorted(r for r, a in hosts.items() if a == address)
            if address != mine and set(ranks) <= set(silent) and not host_answers(address):
                return address, ranks
        return None

    def dead_host(self, silent: list[int]) -> tuple[str, list[int]] | None:
        """(address, ranks) of another host all of whose ranks are silent although it answers on the network
        (its processes were killed); None on a single host."""
        hosts = self._hosts() or self._known_hosts
        mine = hosts.get(self.rank)
        if len(set(hosts.values())) < 2:
            return None
        for address in dict.fromkeys(hosts[r] for r in silent if r in hosts):
            ranks = sorted(r for r, a in hosts.items() if a == address)
            if address != mine and set(ranks) <= set(silent):
                return address, ranks
        return None

    def _store_elsewhere(self) -> bool:
        """Whether the job store (node 0's launcher) runs on another host than this rank's."""
        store_host = getattr(self.job_store, "host", None)
        try:
            loopback = ipaddress.ip_address(store_host).is_loopback
        except ValueError:
            loopback = False
        return bool(store_host) and not loopback and store_host != host_address()

    def _hosts(self) -> dict[int, str]:
        try:
            # Keyed by the id each rank beats under (its member id under --heal), told back by rank.
            found = self.job_store.hosts_of(self.members)
        except RuntimeError:
            return {}
        return {rank: found[m] for rank, m in enumerate(self.members) if m in found}


def flight_dumper(run_dir: str | Path, rank: int, world_size: int) -> Callable[[str], None]:
    """Write this rank's flight recorder to RUN_DIR/flight/rank-R.json, with the reason (``ringtrain
    diagnose RUN_DIR`` reads every rank's)."""
    path = Path(run_dir) / FLIGHT_DIR / f"rank-{rank}.json"

    def dump(reason: str) -> None:
        flight.dump(path, reason, rank, world_size, host=socket.gethostname())

    return dump


FLIGHT_DIR = "flight"


_STORE_WAIT_S = 3.0


def _within(call: Callable[[], object], timeout_s: float, default: object) -> object:
    """``call()``, or ``default`` if it has not returned within ``timeout_s`` (it is left running, in a
    daemon thread: the process is about to fail anyway)."""
    result = [default]

    def run() -> None:
        result[0] = call()

    thread = threading.Thread(target=run, name="ringtrain-watch-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return default if thread.is_alive() else result[0]


def host_address() -> str:
    """This rank's host as its peers know it: the address its sockets bind to, else its host id."""
    return DistEnv.from_environ().bind_addr or host_id()


def host_answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a host answers on the network: a TCP connection to its discard port (9) is accepted or
    refused (the host is up), not met with silence or 'no route' (its link or the host is down). Host ids
    that are not addresses (a rank without a bind address) count as answering: nothing to probe."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect((address, 9))
        except ConnectionRefusedError:
            return True
        except OSError as err:
            return err.errno not in (None, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)
    return True


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


def first_line(text: str) -> str:
    """The first line of a backend's error, without Gloo's source location and advice."""
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    # Gloo prefixes its source location: "[/path/to/pair.cc:545] Read error ...".
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0]
