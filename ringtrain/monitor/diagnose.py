"""``ringtrain diagnose RUN_DIR``: line up every rank's flight recorder and say why the job hangs.

Each rank's dump (RUN_DIR/flight/rank-R.json, written by comm/flight.py when a collective fails or on
SIGUSR1 to the launcher) lists the collectives it issued, in order, as two streams: ringtrain's own
(``ringtrain.comm``, numbered by ringtrain) and the process group's as torch's flight recorder numbers them
(DDP's bucket all-reduces, the step agreement, metrics gathers). In a healthy data-parallel job every rank
issues the same collectives in the same order, so within a stream the n-th collective must be the same
operation, size and dtype on every rank. Three findings explain most hangs:

- a rank with no dump: it died or is stopped (SIGSTOP, swapped out), the usual culprit;
- a rank behind: its last collective is earlier than the others', which wait for it in the next one;
- ranks that disagree: the n-th collective differs in operation, size or dtype (a rank took another branch).

    $ ringtrain diagnose runs/lm
    flight recorder: ranks 0, 1 of 2 (rank 0: requested; rank 1: requested)
    torch collectives (default_pg): rank 1 is behind: its last is #41 allreduce (step agreement, step 20), done;
      rank 0 waits in #42 allreduce 44.7 MB float (DDP gradient sync, step 21) for 12.3 s
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtrain.group.watch import FLIGHT_DIR
from ringtrain.errors import RingtrainError

__all__ = ["DiagnoseError", "Finding", "diagnose", "load_dumps"]

STALE_S = 5.0
"""Dumps written more than this apart answered different requests (heartbeats answer within a beat)."""
STUCK_S = 1.0
"""A rank waiting this long in a collective that a peer has not reached is stuck on that peer."""


class DiagnoseError(RingtrainError):
    """No dumps to read, or an unreadable one."""

    exit_code = 2


@dataclass(frozen=True)
class Finding:
    kind: str
    """'missing', 'mismatch', 'behind', 'stuck' or 'ok'."""
    text: str


@dataclass(frozen=True)
class _Op:
    seq: int
    op: str
    size: str
    dtype: str
    caller: str
    step: int | None
    start_ns: int
    done: bool

    def describe(self, with_size: bool = True) -> str:
        where = ", ".join(part for part in (self.caller, f"step {self.step}" if self.step is not None else "") if part)
        size = f" {self.size} {self.dtype}" if with_size else ""
        return f"#{self.seq} {self.op}{size}" + (f" ({where})" if where else "")


def load_dumps(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's dump in RUN_DIR/flight, by rank."""
    folder = Path(run_dir) / FLIGHT_DIR
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    if not files:
        raise DiagnoseError(
            f"no flight recorder dumps in {folder}: ranks write them when a collective fails, or on request "
            "(send SIGUSR1 to a `ringtrain train` launcher while the job runs; [dist] flight_recorder > 0)"
        )
    dumps = {}
    for path in files:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            dumps[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DiagnoseError(f"{path}: not a flight recorder dump ({err}); delete it and dump again") from None
    return dumps


def diagnose(run_dir: str | Path) -> list[Finding]:
    """What the dumps say, most important first (an 'ok' finding when nothing is wrong)."""
    dumps = load_dumps(run_dir)
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    findings = []
    missing = [r for r in range(world_size) if r not in dumps]
    if missing:
        findings.append(Finding("missing", f"{_ranks(missing)} wrote no dump: dead, stopped (SIGSTOP) or unreachable; "
                                           "the others wait for it"))
    # A dump much older than the newest answered an earlier request: its rank did not answer the last one.
    newest = max(int(d.get("time_ns", 0)) for d in dumps.values())
    stale = sorted(r for r, d in dumps.items() if newest - int(d.get("time_ns", 0)) > STALE_S * 1e9)
    if stale:
        ages = ", ".join(f"rank {r}'s by {(newest - int(dumps[r]['time_ns'])) / 1e9:.1f} s" for r in stale)
        findings.append(Finding("missing", f"{_ranks(stale)} did not answer the last dump: the newest dumps are newer "
                                           f"than {ages} (dead, stopped or unreachable since); left out below"))
        dumps = {r: d for r, d in dumps.items() if r not in stale}
    for name, streams in _streams(dumps).items():
        findings.extend(_compare(name, streams, {r: int(d.get("time_ns", 0)) for r, d in dumps.items()}))
    if not findings:
        findings.append(Finding("ok", f"all {world_size} ranks dumped and agree: same collectives, in the same order, "
                                      "none behind"))
    return findings


def summary_line(run_dir: str | Path) -> str:
    dumps = load_dumps(run_dir)
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    reasons = "; ".join(f"rank {r}: {d.get('reason', '?')}" for r, d in sorted(dumps.items()))
    return f"flight recorder: {_ranks(sorted(dumps))} of {world_size} ({reasons})"


def _streams(dumps: dict[int, dict]) -> dict[str, dict[int, list[_Op]]]:
    """Per stream name, per rank, the collectives in issue order."""
    streams: dict[str, dict[int, list[_Op]]] = {}
    for rank, dump in dumps.items():
        mine = [_Op(e["seq"], e["op"], _mb(e["bytes"]), e["dtype"], e.get("caller") or "", e.get("step"),
                    e["start_ns"], e.get("end_ns") is not None) for e in dump.get("collectives", [])]
        streams.setdefault("ringtrain collectives", {})[rank] = mine
        for e in dump.get("torch", []):
            if e.get("p2p") or e.get("seq") is None:
                continue  # point-to-point (ringtrain's ring) is numbered per pair; its collective is above
            ops = streams.setdefault(f"torch collectives ({e.get('pg') or 'group'})", {})
            ops.setdefault(rank, []).append(_Op(int(e["seq"]), e["op"], _sizes(e.get("sizes", [])),
                                                ",".join(e.get("dtypes", [])).lower(), e.get("caller") or "",
                                                e.get("step"), int(e.get("start_ns", 0)), bool(e.get("completed"))))
    # A stream nobody used (a job that ran no ringtrain collective) says nothing.
    return {name: ranks for name, ranks in streams.items() if any(ranks.values())}


def _compare(name: str, ranks: dict[int, list[_Op]], dumped_ns: dict[int, int]) -> list[Finding]:
    findings = []
    by_seq: dict[int, dict[int, _Op]] = {}
    for rank, ops in ranks.items():
        for op in ops:
            by_seq.setdefault(op.seq, {})[rank] = op
    # Disagreement: the same position holds different collectives (only where the ring buffers overlap).
    for seq in sorted(by_seq):
        seen = by_seq[seq]
        kinds = {(op.op, op.size, op.dtype) for op in seen.values()}
        if len(seen) > 1 and len(kinds) > 1:
            parts = "; ".join(f"rank {r}: {op.describe()}" for r, op in sorted(seen.items()))
            findings.append(Finding("mismatch", f"{name}: ranks disagree at #{seq}: {parts}"))
            break
    last = {rank: ops[-1] for rank, ops in ranks.items() if ops}
    if not last:
        return findings
    # How long each rank had waited in its last collective when it dumped (0: that one was done). Ranks of
    # a live job dump a beat apart and are at different collectives without anything being wrong: only a
    # wait of STUCK_S or more makes a rank that is further back "behind".
    waited = {r: 0.0 if op.done else (dumped_ns.get(r, 0) - op.start_ns) / 1e9 for r, op in last.items()}
    front = max(op.seq for op in last.values())
    behind = sorted(r for r, op in last.items() if op.seq < front)
    waiting = sorted(r for r in last if last[r].seq == front and waited[r] >= STUCK_S)
    if behind and waiting:
        lines = [f"{name}: {_ranks(behind)} {'is' if len(behind) == 1 else 'are'} behind: "
                 + "; ".join(f"rank {r}'s last is {last[r].describe(False)}, {'done' if last[r].done else 'in flight'}"
                             for r in behind)]
        lines += [f"rank {r} waits in {last[r].describe()} for {waited[r]:.1f} s" for r in waiting]
        findings.append(Finding("behind", "; ".join(lines)))
    elif not behind and all(waited[r] >= STUCK_S for r in last):
        op = last[min(last)]
        findings.append(Finding("stuck", f"{name}: every rank waits in {op.describe()} (for {min(waited.values()):.1f} s "
                                         "or more): a rank that wrote no dump, or the link between them"))
    return findings


def _mb(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KB"
    return f"{nbytes} B"


def _sizes(sizes: list) -> str:
    return "+".join("x".join(map(str, shape)) or "1" for shape in sizes) or "-"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
