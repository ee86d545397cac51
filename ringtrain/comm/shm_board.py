"""Synchronisation through flags in shared memory: the ranks of one host meet without a TCP round trip.

Each local rank owns one 64-byte line of the segment's header: an arrival counter, its pid, and the
descriptor of the collective it is in (double-buffered by counter parity). ``arrive()`` bumps the counter;
``wait_all(count)`` returns once every peer's counter has reached ``count``. All ranks pass the same
sequence of barriers, so counters agree without any other bookkeeping.

Memory ordering: a rank writes its data, then its counter, with plain stores from one thread; x86-64 is
TSO (stores become visible in program order, loads are not reordered with other loads), so a peer that sees
the counter sees the data. Weakly ordered CPUs would need fences that Python cannot issue, which is why
shm is refused there (``require_tso``).

Waiting spins on the peer's line for up to 2 ms when every rank has a core of its own (the fastest
hand-over), or yields (``sched_yield``) when ranks share cores so that the peer can run; then it sleeps with
backoff. The clock is read every 256 looks while spinning; peer liveness (``/proc/<pid>/stat``) every
20 ms after that. A dead peer
fails the wait within milliseconds, a stopped one at the timeout, and the first rank to notice posts the
culprit and reason on a shared abort line, as one 64-bit word in one store, so every other rank fails
naming the same rank for the same reason::

    >>> count = board.arrive(descriptor)      # after writing this rank's data
    >>> board.wait_all(count, "shm all_reduce", step=1, steps=2, timeout_s=60.0)
"""

from __future__ import annotations

import os
import platform
import time

import torch

from ringtrain.comm.errors import CollectiveError, MismatchError, PeerDiedError, PeerTimeoutError
from ringtrain.testing import faults

__all__ = ["FlagBoard", "header_bytes", "require_tso", "describe_call", "encode_call"]

LINE = 8  # int64 words per 64-byte line: one line per rank, so ranks never write the same cache line
_COUNT, _PID, _DESC = 0, 1, 2  # _DESC: two slots of 3 words (numel, code, offset), chosen by count parity
# The abort line's first word is the report (below); its second counts the native path's ranks asleep on a
# futex (csrc/shm_native.cpp), which its arrivals wake; its third, which kind of store the native path's
# staged calls use per message size (written by local rank 0 only). This board's waits never sleep there.
_DIED, _TIMEOUT, _MISMATCH = 1, 2, 3
# The abort line's first word holds the whole report, packed: reason (bits 56+), culprit and reporter (16 bits
# each, local ranks), step (24 bits). One aligned 8-byte store is atomic on x86-64, so two ranks failing at
# once leave one rank's report whole (whichever store lands last), never one's culprit with the other's reason.
_STEP_MAX = (1 << 24) - 1

_SPIN_S = 0.002  # ranks on cores of their own spin this long before sleeping
_YIELD_S = 0.002  # ranks sharing cores yield this long before sleeping
_NAP_S = 250e-6  # longest sleep between looks during the first 100 ms of a wait
_LIVENESS_EVERY_S = 0.02

_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")
_OPS = ("sum", "avg", "max", "min", "product")  # appended only: the native path's codes are those of the first
_COMMON = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8,
)
# Every dtype gets a code of its own (one shared code for "other" let uint16 pass for uint32): the common
# ones first, then all others torch defines, by name. Ranks of one host run one torch, so the codes agree.
_DTYPES = _COMMON + tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)} - set(_COMMON), key=str))
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def header_bytes(local_size: int) -> int:
    """Bytes of the flag header for ``local_size`` ranks (one line each plus the abort line), page aligned."""
    return -(-(local_size + 1) * LINE * 8 // 4096) * 4096


def require_tso() -> None:
    """Refuse CPUs whose stores may become visible out of order (see the module docstring)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        raise RuntimeError(
            f"algorithm='shm' relies on x86's total store order and this CPU is {machine}; use algorithm='ring'"
        )


def encode_call(kind: str, op: str, dtype: torch.dtype, numel: int, offset: int = -1) -> tuple[int, int, int]:
    """What a rank is about to do, as three integers peers can compare with theirs."""
    code = _KINDS.index(kind) * 10_000 + _OPS.index(op) * 1_000 + _DTYPE_CODE[dtype]
    return numel, code, offset


def describe_call(desc: tuple[int, int, int]) -> str:
    numel, code, offset = desc
    kind, rest = divmod(code, 10_000)
    op, dtype = divmod(rest, 1_000)
    dtype_name = str(_DTYPES[dtype]).replace("torch.", "") if dtype < len(_DTYPES) else "?"
    if offset < 0:
        where = ""
    elif _KINDS[kind] == "broadcast":  # a c10d broadcast's root (shm_ops.broadcast)
        where = f" from rank {offset}"
    else:
        where = f" at shared offset {offset}"
    return f"{_KINDS[kind]}({_OPS[op]}) of {numel} {dtype_name}{where}"


class FlagBoard:
    """The flag header of one host's segment, seen by one local rank."""

    def __init__(self, buf, local_rank: int, local_size: int, ranks: list[int], spin: bool = True):
        """``ranks``: the global rank of each local rank, for messages. ``spin``: False when ranks share cores."""
        self.flags = memoryview(buf)[: header_bytes(local_size)].cast("q")
        self.local_rank = local_rank
        self.local_size = local_size
        self.ranks = ranks
        self.peers = [r for r in range(local_size) if r != local_rank]
        self.mine = local_rank * LINE
        self.abort_line = local_size * LINE
        self.spin = spin
        self.pids: list[int] = []
        self.check_liveness = True

    # --- set-up ------------------------------------------------------------------------------------
    def publish_pid(self) -> None:
        self.flags[self.mine + _PID] = os.getpid()

    def read_pids(self) -> None:
        """After every rank has published: remember the pids, and whether this process can see them."""
        self.pids = [self.flags[r * LINE + _PID] for r in range(self.local_size)]
        # In another pid namespace a peer's pid means nothing here: rely on the timeout alone.
        self.check_liveness = all(os.path.exists(f"/proc/{pid}") for pid in self.pids)

    # --- the hot path ---------------------------------------------------------------------------------
    def arrive(self, desc: tuple[int, int, int] | None = None) -> int:
        """Announce that this rank's data for the next barrier is written; return the barrier's count."""
        flags = self.flags
        if flags[self.abort_line]:
            raise self._aborted("shm", 0, 0)
        count = flags[self.mine] + 1  # this rank's own line holds its count (the native path bumps it too)
        if desc is not None:
            base = self.mine + _DESC + 3 * (count & 1)
            flags[base], flags[base + 1], flags[base + 2] = desc
        # Last: on x86 (TSO) a peer that sees the new count also sees everything written before it.
        flags[self.mine] = count
        faults.point("shm.arrive")
        return count

    def wait_all(self, count: int, what: str, step: int, steps: int, timeout_s: float) -> None:
        """Return once every local rank has arrived at ``count``; raise CollectiveError naming the one that
        died, stopped or never came."""
        flags = self.flags
        for peer in self.peers:
            if flags[peer * LINE] < count:
                self._wait_slow(peer, count, what, step, steps, timeout_s)

    def check_same_call(self, count: int, desc: tuple[int, int, int], what: str) -> None:
        """After ``wait_all(count)``: every peer announced the same call (sizes, dtype, op, offset)."""
        flags = self.flags
        slot = _DESC + 3 * (count & 1)
        for peer in self.peers:
            base = peer * LINE + slot
            theirs = (flags[base], flags[base + 1], flags[base + 2])
            if theirs != desc:
                self._post_abort(peer, _MISMATCH, 1)
                raise MismatchError(
                    f"{what}: rank {self.ranks[peer]} called {describe_call(theirs)} while rank "
                    f"{self.ranks[self.local_rank]} called {describe_call(desc)}; every rank must call the same "
                    "collectives in the same order with the same sizes and dtypes",
                    peer=self.ranks[peer],
                )

    @property
    def count(self) -> int:
        """Barriers this rank has arrived at."""
        return self.flags[self.mine]

    # --- waiting and failing --------------------------------------------------------------------------
    def _wait_slow(self, peer: int, count: int, what: str, step: int, steps: int, timeout_s: float) -> None:
        flags = self.flags
        line = peer * LINE
        if self.spin:
            # A core of our own: spin. The clock is read once per 256 looks, not on every one.
            spin_until = time.monotonic() + _SPIN_S
            while True:
                for _ in range(256):
                    if flags[line] >= count:
                        return
                if time.monotonic() > spin_until:
                    break
        start = time.monotonic()
        deadline = start + timeout_s
        # Sharing cores with the peers: yield so that they run. Otherwise sleep, never yield: under CFS
        # sched_yield hands the core to any other runnable process for the rest of its slice (a 4 ms tick
        # on a busy machine), while a sleeper is woken as soon as its timer fires.
        yield_until = start + (_YIELD_S if not self.spin else 0.0)
        next_check = start + _LIVENESS_EVERY_S
        pause_s = 20e-6
        while flags[line] < count:
            if flags[self.abort_line]:
                raise self._aborted(what, step, steps)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                state = self._state(peer)
                if state == "dead":
                    if flags[line] >= count:  # it arrived, then exited: not our problem
                        return
                    self._post_abort(peer, _DIED, step)
                    raise self._died(peer, what, step, steps)
                if now >= deadline:
                    self._post_abort(peer, _TIMEOUT, step)
                    raise self._timed_out(peer, what, step, steps, timeout_s, state)
            if now < yield_until:
                os.sched_yield()
            else:
                time.sleep(pause_s)
                # Short naps while a peer is merely late; long ones once it is clearly stuck.
                pause_s = min(pause_s * 2, _NAP_S if now - start < 0.1 else 5e-3)

    def _died(self, peer: int, what: str, step: int, steps: int) -> PeerDiedError:
        return PeerDiedError(
            f"{what}: rank {self.ranks[peer]} (pid {self.pids[peer]}) died while rank "
            f"{self.ranks[self.local_rank]} waited at step {step} of {steps}",
            peer=self.ranks[peer],
        )

    def _timed_out(self, peer: int, what: str, step: int, steps: int, timeout_s: float, state: str) -> PeerTimeoutError:
        hint = " (the process is stopped: SIGSTOP or a debugger?)" if state == "stopped" else ""
        return PeerTimeoutError(
            f"{what}: rank {self.ranks[peer]} (pid {self.pids[peer]}) did not arrive within "
            f"{timeout_s:g} s while rank {self.ranks[self.local_rank]} waited at step {step} of {steps}{hint}",
            peer=self.ranks[peer],
        )

    def native_failure(self, failure: tuple[int, int, int, int, int], desc: tuple[int, int, int], what: str,
                       timeout_s: float) -> CollectiveError:
        """The error for a failure the native path (``csrc/shm_native.cpp``) reported: the same as this
        board's own waits raise. ``failure``: (reason, peer, step, steps, count), local ranks; the native
        path has posted the abort line already, except for a mismatch, which is posted here."""
        reason, peer, step, steps, count = failure
        if reason == _DIED:
            return self._died(peer, what, step, steps)
        if reason == _TIMEOUT:
            return self._timed_out(peer, what, step, steps, timeout_s, self._state(peer))
        if reason == _MISMATCH:
            try:
                self.check_same_call(count, desc, what)
            except MismatchError as err:
                return err
        return self._aborted(what if steps else "shm", step, steps)

    def _state(self, peer: int) -> str:
        """'running', 'stopped', 'dead' (exited, killed, or a zombie), or 'unknown' (not visible here)."""
        if not self.check_liveness or not self.pids:
            return "unknown"
        try:
            with open(f"/proc/{self.pids[peer]}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "dead"
        except (OSError, IndexError):
            return "unknown"
        if state in (b"Z", b"X", b"x"):
            return "dead"
        return "stopped" if state in (b"T", b"t") else "running"

    def _post_abort(self, culprit: int, reason: int, step: int) -> None:
        """Tell every local rank who broke the group, so they fail naming it: one store of the packed report."""
        if self.flags[self.abort_line]:
            return  # somebody reported already; racing reports are each whole (see _STEP_MAX)
        self.flags[self.abort_line] = reason << 56 | culprit << 40 | self.local_rank << 24 | min(step, _STEP_MAX)

    def _aborted(self, what: str, step: int, steps: int) -> CollectiveError:
        report = self.flags[self.abort_line]  # one load: the report of one rank
        reason, culprit, reporter = report >> 56, (report >> 40) & 0xFFFF, (report >> 24) & 0xFFFF
        rank, me = self.ranks[culprit], self.ranks[self.local_rank]
        pid = f" (pid {self.pids[culprit]})" if self.pids else ""
        happened = {_DIED: "died", _TIMEOUT: "timed out", _MISMATCH: "called a different collective"}.get(reason, "failed")
        where = f" while rank {me} waited at step {step} of {steps}" if steps else f"; rank {me} cannot use this group any more"
        error = {_DIED: PeerDiedError, _TIMEOUT: PeerTimeoutError, _MISMATCH: MismatchError}.get(reason, CollectiveError)
        return error(f"{what}: rank {rank}{pid} {happened} (seen by rank {self.ranks[reporter]}){where}", peer=rank)
