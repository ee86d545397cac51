"""The collective flight recorder: every rank's last N collectives, dumped when one fails or on request.

Most hangs in data-parallel jobs are ranks that disagree: one rank is a collective behind (it died, stopped,
or took another branch), or two ranks issued different operations or sizes at the same position. Neither
shows in an error message; both show when every rank's recent collectives are lined up. So each process
keeps a ring buffer of what it issued, in order:

- ringtrain's own collectives (``ringtrain.comm``: ring, ring_chunked, shm, torch), recorded here with the
  sequence number, operation, algorithm, bytes, dtype, the caller (the region the trainer named: "DDP
  gradient sync", "step agreement", "evaluation", ...) and step, start and end;
- the shm all-reduces of its C++ fast path (``comm.all_reduce(algorithm="shm")``), which that path records
  itself (``attach``: a Python entry cost 0.5 us a call) with the caller and step of the region open, and
  which are merged in by start time, numbered in the same sequence;
- the process group's collectives as torch's own flight recorder sees them (DDP's bucket all-reduces run
  in C++ and never pass through Python): enabled by ``TORCH_FR_BUFFER_SIZE`` before the group is created
  (``torch_recorder_env``), read at dump time and attributed to the region open when they were issued.

``dump(path, reason)`` writes both as one JSON file; ``ringtrain diagnose RUN_DIR`` (monitor/diagnose.py)
lines up every rank's file. A rank stuck inside a collective cannot run Python in its main thread, so the
dump on request comes from a watchdog thread (the heartbeat's, group/watch.py).

    flight.enable(capacity=2000)
    with flight.region("DDP gradient sync", step=37):
        comm.all_reduce(bucket, algorithm="shm")          # recorded as #n, caller "DDP gradient sync"
    flight.dump(Path("run/flight/rank-0.json"), reason="requested", rank=0, world_size=2)

Recording costs a few microseconds per collective and nothing while disabled (the default outside the
trainer, so ``comm``'s own benchmarks measure the collectives alone).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_CAPACITY", "FlightRecorder", "begin", "discard", "dump", "enable", "end", "recorder", "region",
           "torch_recorder_env"]

DEFAULT_CAPACITY = 2000
TORCH_BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
FORMAT_VERSION = 1


class FlightRecorder:
    """A ring buffer of this process's collectives and of the caller regions around them."""

    def __init__(self, capacity: int = 0):
        self.capacity = 0
        self.seq = 0
        self.entries: collections.deque[list] = collections.deque()
        self.regions: collections.deque[list] = collections.deque()
        self.caller = ""
        self.step: int | None = None
        self._lock = threading.Lock()  # a dump from the watchdog thread copies while the main thread records
        # Native recorders (shm's workspaces): each keeps its own ring; ``detach`` freezes a closed one's records.
        self.sources: list = []
        self.callers: dict[str, int] = {}  # the native records name their caller by a code: the index here
        self.frozen: collections.deque[tuple[int, list]] = collections.deque()
        self.dropped_calls, self.dropped_before_ns = 0, 0
        self.resize(capacity)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def resize(self, capacity: int) -> None:
        """Keep the last ``capacity`` collectives (0: record nothing)."""
        if capacity < 0:
            raise ValueError(f"flight recorder capacity must be >= 0, got {capacity}")
        with self._lock:
            self.capacity = capacity
            self.entries = collections.deque(self.entries, maxlen=max(capacity, 1))
            self.regions = collections.deque(self.regions, maxlen=max(capacity, 1))
            for source in self.sources:
                if source.flight_records()[0] > 0:  # its records so far are dropped: the merged list starts now
                    self.dropped_before_ns = time.time_ns()
                source.flight_capacity = capacity

    def attach(self, source) -> None:
        """Merge the records of a native path into this recorder's: ``source.flight_capacity`` (settable) and
        ``source.flight_records()`` -> (calls since it started, [(bytes, dtype, average, start_ns, end_ns), ...]
        of the last ones, oldest first; end_ns 0 while running or after a failure)."""
        with self._lock:
            source.flight_capacity = self.capacity
            self.sources.append(source)
            self.tell_region(source)

    def tell_region(self, source) -> None:
        """Tell ``source`` the region open now (its records carry it as Python's entries do)."""
        source.set_region(self.callers.setdefault(self.caller, len(self.callers)) if self.caller else -1, self.step)

    def detach(self, source) -> None:
        """``source`` is closing: keep what it recorded (the last few closed sources' records are kept)."""
        with self._lock:
            if source not in self.sources:
                return
            self.sources.remove(source)
            self.frozen.append(source.flight_records())
            while len(self.frozen) > _FROZEN_SOURCES:
                calls, records = self.frozen.popleft()
                self.dropped_calls += calls
                if records:
                    self.dropped_before_ns = max(self.dropped_before_ns, records[-1][3] + 1)

    def begin(self, op: str, algorithm: str, tensor: torch.Tensor) -> list | None:
        """Record the start of a collective; pass the result to ``end``. None (nothing recorded) when off."""
        if not self.capacity:
            return None
        self.seq += 1
        # A list, not an object: this runs on every collective; the field order is _ENTRY_FIELDS. The dtype is
        # kept as it is and named in snapshot(): str(dtype) took a quarter of this function's 0.7 us.
        entry = [self.seq, op, algorithm, tensor.nbytes, tensor.dtype, self.caller, self.step, time.time_ns(), None]
        self.entries.append(entry)  # deque.append is atomic; snapshot() copies the deque at once
        return entry

    def discard(self, entry: list | None) -> None:
        """Forget ``entry``, the last one begun: its call handed the collective on to a path that records it."""
        if entry is not None and self.entries and self.entries[-1] is entry:
            self.entries.pop()
            self.seq -= 1

    @staticmethod
    def end(entry: list | None) -> None:
        """The collective completed (an entry never ended was in flight, or failed, when dumped)."""
        if entry is not None:
            entry[-1] = time.time_ns()

    def region(self, caller: str, step: int | None = None) -> _Region:
        """Name the caller of the collectives issued inside (the trainer's operations: DDP sync, ...);
        a context manager."""
        return _Region(self, caller, step)

    def snapshot(self) -> dict[str, Any]:
        """What this process recorded, as plain data (ringtrain's entries, regions, torch's entries)."""
        with self._lock:
            # list(deque) runs in C under the GIL: a consistent copy while the main thread appends.
            entries = [list(e) for e in list(self.entries)]
            regions = [list(r) for r in list(self.regions)]
            rings = [source.flight_records() for source in self.sources] + list(self.frozen)
            seq, dropped_calls, cutoff = self.seq, self.dropped_calls, self.dropped_before_ns
            callers = list(self.callers)
        return {
            "collectives": _merge(entries, seq, rings, dropped_calls, cutoff, callers),
            "regions": [dict(zip(_REGION_FIELDS, r)) for r in regions],
            "torch": _torch_entries(regions),
        }

    def dump(self, path: str | Path, reason: str, rank: int, world_size: int, **extra: Any) -> Path:
        """Write the snapshot to ``path`` (JSON, atomically: a temporary file renamed over it)."""
        path = Path(path)
        record = {
            "version": FORMAT_VERSION,
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "reason": reason,
            "time_ns": time.time_ns(),
            "capacity": self.capacity,
            **extra,
            **self.snapshot(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(temp, path)
        return path


class _Region:
    """``FlightRecorder.region``: a plain class, not a generator, as it wraps every collective of a step."""

    __slots__ = ("recorder", "caller", "step", "span", "outer")

    def __init__(self, recorder: FlightRecorder, caller: str, step: int | None):
        self.recorder, self.caller, self.step = recorder, caller, step
        self.span: list | None = None

    def __enter__(self) -> None:
        recorder = self.recorder
        if not recorder.capacity:
            return
        self.outer = (recorder.caller, recorder.step)
        self.span = [self.caller, self.step, time.time_ns(), None]
        recorder.regions.append(self.span)  # deque.append is atomic; snapshot() copies the deque at once
        recorder.caller, recorder.step = self.caller, self.step
        for source in recorder.sources:
            recorder.tell_region(source)

    def __exit__(self, *exc) -> None:
        if self.span is not None:
            self.span[-1] = time.time_ns()
            recorder = self.recorder
            recorder.caller, recorder.step = self.outer
            for source in recorder.sources:
                recorder.tell_region(source)


_ENTRY_FIELDS = ("seq", "op", "algorithm", "bytes", "dtype", "caller", "step", "start_ns", "end_ns")
_FROZEN_SOURCES = 4
"""Closed native sources whose records a recorder keeps (a heal closes the group's workspace; its last calls
matter in the next dump)."""


def _merge(entries: list[list], seq: int, rings: list[tuple[int, list]], dropped_calls: int, dropped_before_ns: int,
           callers: list[str]) -> list[dict[str, Any]]:
    """Python's entries and the native rings' records as one sequence by start time, numbered 1.. over every
    collective of the process. Each ring keeps only its last calls: the merged list starts where every ring
    still holds all of its calls (a ring that lost older ones cuts the list at its oldest kept), so the
    numbers, counted back from the total, are exact. ``callers``: the native records' caller codes, by index."""
    merged = [(e[7], dict(zip(_ENTRY_FIELDS, e), dtype=_dtype_name(e[4]))) for e in entries]
    cutoff = dropped_before_ns
    if len(entries) < seq and entries:
        cutoff = max(cutoff, entries[0][7])
    total = seq + dropped_calls
    for calls, records in rings:
        total += calls
        if records and len(records) < calls:
            cutoff = max(cutoff, records[0][3])
        for nbytes, dtype, _average, start, end, caller, step in records:
            caller = callers[caller] if 0 <= caller < len(callers) else ""
            merged.append((start, {"seq": 0, "op": "all_reduce", "algorithm": "shm", "bytes": nbytes,
                                   "dtype": _dtype_name(dtype), "caller": caller, "step": step, "start_ns": start,
                                   "end_ns": end or None}))
    if not rings:  # only Python's entries: their own numbers
        return [entry for _, entry in merged]
    kept = [entry for start, entry in sorted(merged, key=lambda pair: pair[0]) if start >= cutoff]
    for index, entry in enumerate(kept):
        entry["seq"] = total - len(kept) + 1 + index
    return kept


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")
_REGION_FIELDS = ("caller", "step", "start_ns", "end_ns")


def _torch_entries(regions: list[list]) -> list[dict[str, Any]]:
    """The process group's collectives from torch's flight recorder (empty unless TORCH_FR_BUFFER_SIZE was
    set when the group was created), each given the innermost region open when it was issued."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
        raw = json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # no process group, no recorder, or an older torch: nothing to add
        return []
    found = []
    for e in raw.get("entries", []):
        created = e.get("time_created_ns", 0)
        caller, step = _region_at(regions, created)
        found.append({
            "pg": _group_name(e.get("process_group") or ["", ""]),
            "seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
            "p2p": bool(e.get("is_p2p")),
            "op": e.get("profiling_name", "").split(":", 1)[-1],
            "sizes": e.get("input_sizes", []),
            "dtypes": e.get("input_dtypes", []),
            "caller": caller,
            "step": step,
            "start_ns": created,
            "completed": bool(e.get("retired")) or bool(e.get("time_discovered_completed_ns")),
        })
    return found


def _group_name(process_group: list) -> str:
    """torch names its groups [id, description]; groups made by new_group are described as 'undefined'."""
    number, description = (list(process_group) + ["", ""])[:2]
    return description if description not in ("", "undefined") else f"group {number}"


def _region_at(regions: list[list], when_ns: int) -> tuple[str, int | None]:
    """The innermost (latest started) region that was open at ``when_ns``."""
    for caller, step, start, end in reversed(regions):
        if start <= when_ns and (end is None or when_ns <= end):
            return caller, step
    return "", None


_RECORDER = FlightRecorder()


def recorder() -> FlightRecorder:
    """This process's recorder (ringtrain.comm records into it)."""
    return _RECORDER


def enable(capacity: int = DEFAULT_CAPACITY) -> FlightRecorder:
    """Start recording the last ``capacity`` collectives (0 stops)."""
    _RECORDER.resize(capacity)
    return _RECORDER


def torch_recorder_env(capacity: int = DEFAULT_CAPACITY) -> None:
    """Ask torch to record the process group's collectives too (read when a group is created); a value the
    user set is kept."""
    if capacity > 0:
        os.environ.setdefault(TORCH_BUFFER_VAR, str(capacity))


# The recorder's own methods rather than functions that call them: one Python call less per collective.
begin = _RECORDER.begin
"""Record the start of a collective in this process's recorder (``FlightRecorder.begin``)."""
end = FlightRecorder.end
"""Record that the collective ``begin`` returned completed (``FlightRecorder.end``)."""
discard = _RECORDER.discard
"""Forget the entry ``begin`` returned, whose call handed the collective on (``FlightRecorder.discard``)."""


def region(caller: str, step: int | None = None):
    return _RECORDER.region(caller, step)


def dump(path: str | Path, reason: str, rank: int, world_size: int, **extra: Any) -> Path:
    return _RECORDER.dump(path, reason, rank, world_size, **extra)
