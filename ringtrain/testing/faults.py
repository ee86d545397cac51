"""Fault injection for tests: named points placed in the code, armed only by a test harness's plan.

A chaos test needs a worker to fail *inside* something: part-way through the ring all-reduce (the survivors
then hold partial sums), between a checkpoint's data file and its manifest, in a micro-batch's forward. A kill
from outside lands anywhere; a *point* marks the place, one line in the product code, declared once in
``POINTS``::

    faults.point("ring.step")           # comm/ring.py: after each step of the ring

Nothing is armed in a user's run, and then ``point()`` is a call and one global check: 0.13-0.21 us against
0.01-0.02 us for ``pass`` (``python -m timeit -s "from ringtrain.testing import faults"
"faults.point('ring.step')"``, best of 5, on the 2-core test machine at load 15), beside a ring step's
tens of microseconds at least. A test arms a *plan*: a JSON file it writes with ``write_plan`` (a list of
``Fault``). The launched job learns its path from one environment variable (``RINGTRAIN_FAULT_PLAN``, read in
``group/env.py`` only); each worker arms it as it builds its trainer (``train/build.py``) and takes the variable
out of its own environment, so nothing it starts inherits it, and ``ringtrain join`` takes it out too, so a
joiner is never armed. No config field, function name or inherited environment arms a point.

A plan's path alone arms nothing: a test opts in explicitly beside it. ``write_plan`` puts a fresh random
``opt_in`` in the plan (``i-am-a-test-`` and 32 hex digits: 128 bits, made for this plan only), and the harness
hands the same value to the job in a second variable, ``RINGTRAIN_FAULT_PLAN_ARMED`` (``tests/faults.py``
``Plan.env``; in-process, ``arm(path, opt_in=...)``). ``arm`` arms only when the value it is given has that form
and equals the plan's own: ``RINGTRAIN_FAULT_PLAN`` left in a production shell, a CI runner's environment or a
container image (a variable a user's environment can hold by accident) is ignored with one warning line, and
a stale opt-in from another test never matches a new plan. Armed, a process says so on stderr:
``ringtrain: fault plan PATH armed (test facility)``.

A fault matches a point's name and, where it gives them, the process's ``rank`` (its rank now), ``member``
(the rank it was launched as: its member id under --heal), ``generation``, ``step`` (the optimizer step being
trained, counted from 1 as in metrics.jsonl; 0 before this process's first one) and ``hit`` (the point's n-th
reach within that step; unset: its first matching reach). The trainer says where it is with
``context(step=..., rank=...)`` once per step; a point may add its own (``point("checkpoint.save.commit",
step=step)``). Actions: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP: the test sends SIGCONT), ``exit``
(``os._exit(code)``), ``raise`` (``error``, by its dotted name from an allow-list, ``raisable_errors()``:
ringtrain's own error types of ``ringtrain/errors.py`` and ``ringtrain/comm/errors.py``, ``InjectedFault``,
and ``torch.OutOfMemoryError``, the one foreign error the trainer handles; nothing else is looked up, no module
is imported by a name a plan gives; with ``message``), ``observe`` (record only: once per process, and it
keeps the point armed), ``flip`` (at a point a value passes, ``data = faults.through(name, data)``: byte
``offset`` inverted, a corrupted wire), ``delay`` (sleep ``seconds`` at every matching reach: it paces a job,
so that a test's joiner, a process that takes seconds to start, meets a job whose steps take milliseconds;
recorded once per process). Any other fault fires at most once per job: a marker beside the plan, created
with O_EXCL, so a worker its agent restarted does not fire it again.

Beside the plan the armed processes append ``<plan>.reached.jsonl`` (each point's first reach per process:
point, rank, member, generation, step, hit, pid) and ``<plan>.fired.jsonl`` (every fault fired, before its
action), so a test asserts that its fault fired, and ``tests/testing/test_fault_points.py`` that every
declared point is still reached by real jobs::

    plan = faults.write_plan(tmp_path / "faults.json", [faults.Fault("ring.step", member=2, step=1, hit=3)])
    # run `ringtrain train ...` with RINGTRAIN_FAULT_PLAN=<plan> in its environment (tests/faults.py)
    assert [f["point"] for f in faults.fired(plan)] == ["ring.step"]

Adding a point: one entry in ``POINTS`` (its name: the file and function it sits in, and what has happened when
it is reached) and one line at that place, ``faults.point("area.what")``; ``tests/testing/test_faults.py`` checks
that each declared point is placed exactly once, in the file its entry names, and the integration test above
that a job reaches it (add a job there if none does). The name is the contract plans use: a plan naming an
undeclared point is refused when written and when armed, and an armed process reaching an undeclared one raises.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ringtrain.errors import RingtrainError

__all__ = ["POINTS", "ACTIONS", "Fault", "FaultPlanError", "InjectedFault", "OPT_IN_PREFIX", "point", "through", "context",
           "armed_at", "arm", "disarm", "write_plan", "plan_opt_in", "reached", "fired", "raisable_errors"]

POINTS: dict[str, str] = {
    "ring.step": "comm/ring.py RingPeers.run_step: one step of ringtrain's ring done (its send to the right and "
                 "its receive from the left)",
    "shm.arrive": "comm/shm_board.py FlagBoard.arrive: this rank's arrival at an shm barrier published (its data "
                  "visible to the peers); shm's Python path only, which a worker armed here takes",
    "ledger.gathered": "data/ledger.py Ledger.record: after the step's sample-ledger gather (every rank has "
                       "committed the step), before the writer writes its line",
    "step.micro_batch": "train/batch_size.py MicroBatcher.after_forward: after each micro-batch's forward, where "
                        "memory peaks (an injected out-of-memory error)",
    "checkpoint.save.enter": "checkpoint/manager.py CheckpointManager.save: a full save starts, on every rank "
                             "(a non-writer returns right after)",
    "checkpoint.save.commit": "checkpoint/manager.py CheckpointManager.save: the writer's data file written, "
                              "fsynced and renamed into place, before the manifest that commits it",
    "checkpoint.sharded.enter": "checkpoint/sharded.py ShardedCheckpointer.save: a sharded save starts, on every rank",
    "checkpoint.sharded.commit": "checkpoint/sharded.py ShardedCheckpointer._commit: rank 0, every rank's files "
                                 "done, before the manifest that commits them (a background save: in its thread)",
    "train.wrap": "parallel/__init__.py build_parallel: the model built, before the strategy wraps it (DDP's first "
                  "collectives: a worker lost here is lost while the group starts)",
    "train.resume": "train/loop_checkpoints.py Trainer.resume: before every rank agrees which checkpoint to "
                    "continue from (its collectives), on every start",
    "train.evaluate": "train/loop.py Trainer._evaluate: an evaluation (an epoch's or the last one) starts, before "
                      "its collectives",
    "train.finish": "train/loop.py Trainer.finish: the last evaluation and save done, before the summary's "
                    "collectives",
    "diloco.exchange": "parallel/diloco.py DiLoCoStrategy._prepare: a fragment's pseudo-gradient taken, before "
                       "its exchange with the other replicas (an outer sync under way)",
    "heal.form": "heal/supervisor.py Supervisor._settle: the next generation decided (or admitted), before its "
                 "members form its group",
    "heal.settle": "heal/supervisor.py Supervisor._settle: the new generation's group formed, before the members "
                   "compare their state (or reload shards)",
    "heal.transfer": "heal/transfer.py _broadcast_bytes: the state a sender puts on the wire (a flip fault "
                     "corrupts it)",
    "heal.planned": "heal/supervisor.py Supervisor.at_boundary: rank 0 wrote the plan to admit joiners after the "
                    "next step",
    "heal.finished": "heal/supervisor.py Supervisor.run: this member marked the job finished, before it returns "
                     "and its process exits (a delay: a finished worker slow to exit)",
}
"""Every fault point: its name and where it sits. One line of code per point: ``faults.point(name)``."""

ACTIONS = ("kill", "stop", "exit", "raise", "observe", "flip", "delay")
WHERE = ("rank", "member", "generation", "step")
"""What a fault may match besides its point and hit; ``context`` and ``point`` keywords set them."""


class FaultPlanError(RingtrainError):
    """A fault plan names a point, an action or an error that does not exist."""


class InjectedFault(RuntimeError):
    """A ``raise`` fault's error when a test needs one that no product code catches."""


OPT_IN_PREFIX = "i-am-a-test-"
"""A plan's ``opt_in`` (and the value that must be handed to ``arm`` beside it): this, then 32 hex digits."""
_OPT_IN = re.compile(re.escape(OPT_IN_PREFIX) + r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Fault:
    """One fault of a plan: at ``point``, in the process and step the other fields name (None: any), do
    ``action`` once per job."""

    point: str
    action: str = "kill"
    rank: int | None = None
    member: int | None = None
    generation: int | None = None
    step: int | None = None
    hit: int | None = None
    """The point's n-th reach within the step (from 1); None: its first reach where the rest matches."""
    error: str | None = None
    """``raise``: the exception class, by its dotted name from ``raisable_errors()`` (``"torch.OutOfMemoryError"``)."""
    message: str = ""
    """``raise``: the exception's message."""
    code: int = 1
    """``exit``: the exit code."""
    seconds: float = 0.0
    """``delay``: how long each matching reach sleeps."""
    offset: int = 0
    """``flip``: the byte of the value passed through the point (``through``) that is inverted."""

    def check(self, where: str) -> None:
        """Raise FaultPlanError (one line naming the fix) unless every name in this fault exists."""
        if self.point not in POINTS:
            raise FaultPlanError(f"{where}: unknown fault point {self.point!r}; declared points: {', '.join(POINTS)} "
                                 "(ringtrain/testing/faults.py POINTS)")
        if self.action not in ACTIONS:
            raise FaultPlanError(f"{where}: unknown action {self.action!r}; use one of {', '.join(ACTIONS)}")
        if (self.action == "raise") != (self.error is not None):
            raise FaultPlanError(f"{where}: action 'raise' and error go together (e.g. error='torch.OutOfMemoryError')")
        if self.error is not None:
            _error_class(self.error, where)
        if self.hit is not None and self.hit < 1:
            raise FaultPlanError(f"{where}: hit counts from 1, not {self.hit}")

    def matches(self, at: dict[str, Any], hit: int | None = None) -> bool:
        """Whether this fault is for the process and step ``at`` describes (and the ``hit``-th reach; None:
        any step and hit, the process only: ``armed_at``)."""
        keys = WHERE if hit is not None else ("rank", "member", "generation")
        if any(getattr(self, key) is not None and getattr(self, key) != at.get(key) for key in keys):
            return False
        return hit is None or self.hit is None or self.hit == hit


def raisable_errors() -> dict[str, type[BaseException]]:
    """The errors a ``raise`` fault may name, by dotted name: every exception class defined in
    ``ringtrain/errors.py`` and ``ringtrain/comm/errors.py``, ``InjectedFault``, and ``torch.OutOfMemoryError``
    (what an out-of-memory test injects). Fixed modules, imported here by their own names: a plan only picks
    from this table."""
    import torch

    from ringtrain import errors
    from ringtrain.comm import errors as comm_errors

    table: dict[str, type[BaseException]] = {}
    for module in (errors, comm_errors):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                table[f"{module.__name__}.{value.__name__}"] = value
    table[f"{__name__}.InjectedFault"] = InjectedFault
    table["torch.OutOfMemoryError"] = torch.OutOfMemoryError
    return table


def _error_class(name: str, where: str) -> type[BaseException]:
    table = raisable_errors()
    if name not in table:
        shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}..."
        raise FaultPlanError(f"{where}: error {shown} is not one a fault may raise; use one of {', '.join(sorted(table))}")
    return table[name]


# --- in the product code: one global check while nothing is armed ------------------------------------------

_armed: _Armed | None = None


def point(name: str, **where: int) -> None:
    """The fault point ``name`` (declared in POINTS) is reached; ``where`` adds to the context (e.g. the step
    a checkpoint save belongs to). Unarmed, returns at once."""
    if _armed is not None:
        _armed.reach(name, where)


def through(name: str, data: bytes) -> bytes:
    """The fault point ``name`` on bytes in transit: returns ``data``, or a copy with one byte inverted where a
    ``flip`` fault fires (a corrupted wire). Unarmed, returns ``data`` at once."""
    if _armed is None:
        return data
    return _armed.reach(name, {}, data)


def context(**where: int) -> None:
    """Where this process is now (``step``, ``rank``, ``member``, ``generation``): faults match on it. Unarmed:
    nothing."""
    if _armed is not None:
        _armed.update(where)


def armed_at(name: str) -> bool:
    """Whether a fault that has not fired yet waits at point ``name`` for this process (any step): shm asks
    it for ``shm.arrive`` and then takes its Python path, the one whose barriers a point sits between."""
    armed = _armed
    if armed is None or armed.pid != os.getpid():
        return False
    return any(fault.matches(armed.where) and (fault.action == "observe" or not armed.marker(index).exists())
               for index, fault in armed.by_point.get(name, ()))


# --- arming: the test harness's plan ------------------------------------------------------------------------

def write_plan(path: str | Path, faults: list[Fault]) -> Path:
    """Write the plan ``faults`` to ``path`` (checked first: an unknown point or action is one line here), with
    a fresh ``opt_in`` (``plan_opt_in``) that whoever arms it must hand to ``arm`` too."""
    path = Path(path)
    for index, fault in enumerate(faults):
        fault.check(f"fault {index} of {path}")
    opt_in = OPT_IN_PREFIX + secrets.token_hex(16)
    path.write_text(json.dumps({"opt_in": opt_in, "faults": [asdict(fault) for fault in faults]}, indent=1) + "\n")
    return path


def plan_opt_in(path: str | Path) -> str:
    """The ``opt_in`` of the plan ``write_plan`` wrote at ``path``: what the test harness hands to ``arm``
    beside the path (for a launched job: in ``RINGTRAIN_FAULT_PLAN_ARMED``)."""
    return json.loads(Path(path).read_text())["opt_in"]


_ignored: set[str] = set()
"""Plans this process already warned about (a trainer built again by a heal warns once)."""


def arm(path: str | Path, *, opt_in: str | None, **where: int) -> list[Fault]:
    """Arm this process with the plan at ``path`` (the worker: ``train/build.py``; in-process tests: the
    harness), at ``where`` (rank, member, generation), if ``opt_in`` is the plan's own (``write_plan``):
    then one line on stderr says so, and the plan's faults are returned. Without it the plan is ignored with
    one warning line, and nothing is armed (an empty list)."""
    global _armed
    path = Path(path)
    if not isinstance(opt_in, str) or not _OPT_IN.fullmatch(opt_in) or _read_opt_in(path) != opt_in:
        if str(path) not in _ignored:
            _ignored.add(str(path))
            print(f"ringtrain: warning: fault plan {path} ignored: RINGTRAIN_FAULT_PLAN is a test facility and is armed "
                  "only beside its test's opt-in (RINGTRAIN_FAULT_PLAN_ARMED, equal to the plan's opt_in); unset "
                  "RINGTRAIN_FAULT_PLAN", file=sys.stderr, flush=True)
        return []
    try:
        entries = json.loads(path.read_text())["faults"]
        faults = [Fault(**entry) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FaultPlanError(f"fault plan {path} is unreadable ({err}); write it with "
                             "ringtrain.testing.faults.write_plan") from None
    for index, fault in enumerate(faults):
        fault.check(f"fault {index} of {path}")
    _armed = _Armed(path, faults, where)
    print(f"ringtrain: fault plan {path} armed (test facility)", file=sys.stderr, flush=True)
    return faults


def _read_opt_in(path: Path) -> str | None:
    """The plan's ``opt_in``, None when it has none (or is no plan): read only after the given opt-in passed
    its own check, so a production run never opens the file a stray variable names."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
        value = json.loads(text).get("opt_in")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def is_armed() -> bool:
    """Whether this process armed a plan (a trainer built again by a heal arms nothing twice)."""
    return _armed is not None and _armed.pid == os.getpid()


def disarm() -> None:
    """Nothing armed in this process any more (a harness rank that trains on after its faulty run)."""
    global _armed
    _armed = None


def reached(path: str | Path) -> list[dict[str, Any]]:
    """The points the armed processes reached (each one's first reach per process), in order."""
    return _read_lines(Path(f"{path}.reached.jsonl"))


def fired(path: str | Path) -> list[dict[str, Any]]:
    """The faults that fired (their index in the plan, point, action and where), in order."""
    return _read_lines(Path(f"{path}.fired.jsonl"))


class _Armed:
    """This process's plan and where it is; only ever built by ``arm``."""

    def __init__(self, path: Path, faults: list[Fault], where: dict[str, int]):
        self.path = path
        self.pid = os.getpid()  # a forked child (a DataLoader worker) inherits this object, not the arming
        self.by_point: dict[str, list[tuple[int, Fault]]] = {}
        for index, fault in enumerate(faults):
            self.by_point.setdefault(fault.point, []).append((index, fault))
        self.where: dict[str, Any] = {"rank": None, "member": None, "generation": 0, "step": 0, **where}
        self.hits: dict[tuple[str, Any], int] = {}
        self.seen: set[str] = set()
        self.observed: set[int] = set()
        self.delayed: set[int] = set()
        self.lock = threading.Lock()  # a background checkpoint save reaches its commit point in its own thread

    def update(self, where: dict[str, int]) -> None:
        with self.lock:
            if where.get("step", self.where["step"]) != self.where["step"]:
                self.hits.clear()  # hits count within a step
            self.where.update(where)

    def marker(self, index: int) -> Path:
        return Path(f"{self.path}.fired-{index}")

    def reach(self, name: str, where: dict[str, int], data: bytes | None = None) -> bytes | None:
        if os.getpid() != self.pid:
            return data
        if name not in POINTS:
            raise FaultPlanError(f"fault point {name!r} is not declared in ringtrain/testing/faults.py POINTS")
        with self.lock:
            at = {**self.where, **where}
            key = (name, at["step"])
            hit = self.hits[key] = self.hits.get(key, 0) + 1
            if name not in self.seen:
                self.seen.add(name)
                _append(Path(f"{self.path}.reached.jsonl"), {"point": name, **at, "hit": hit, "pid": self.pid})
            due = [(index, fault) for index, fault in self.by_point.get(name, ()) if fault.matches(at, hit)]
        for index, fault in due:
            if fault.action == "flip" and (data is None or not 0 <= fault.offset < len(data)):
                passes = "no value" if data is None else f"{len(data)} bytes"
                raise FaultPlanError(f"fault {index} flips byte {fault.offset} at {name}, which passes {passes} "
                                     "(flip needs a point placed as faults.through)")
            if self._claim(index, fault):
                data = self._fire(index, fault, at, hit, data)
        return data

    def _claim(self, index: int, fault: Fault) -> bool:
        """True for the one process of the job that gets to fire fault ``index`` (O_EXCL on its marker); an
        observing fault: once per process."""
        if fault.action in ("observe", "delay"):
            first = index not in self.observed
            self.observed.add(index)
            return first or fault.action == "delay"
        try:
            os.close(os.open(self.marker(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        return True

    def _fire(self, index: int, fault: Fault, at: dict[str, Any], hit: int, data: bytes | None) -> bytes | None:
        if fault.action == "delay":
            if index not in self.delayed:
                self.delayed.add(index)
                _append(Path(f"{self.path}.fired.jsonl"), {"index": index, "point": fault.point, "action": "delay",
                                                           **at, "hit": hit, "pid": self.pid})
            time.sleep(fault.seconds)
            return data
        _append(Path(f"{self.path}.fired.jsonl"),
                {"index": index, "point": fault.point, "action": fault.action, **at, "hit": hit, "pid": self.pid})
        if fault.action == "observe":
            return data
        if fault.action == "flip":
            return data[:fault.offset] + bytes([data[fault.offset] ^ 0xFF]) + data[fault.offset + 1:]
        print(f"ringtrain: fault plan: {fault.action} at {fault.point} (hit {hit} of step {at['step']}, rank "
              f"{at['rank']}, member {at['member']})", file=sys.stderr, flush=True)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "exit":
            os._exit(fault.code)
        elif fault.action == "raise":
            raise _error_class(fault.error, fault.point)(fault.message or f"fault plan: {fault.point}")


def _append(path: Path, record: dict[str, Any]) -> None:
    """One line in one write to a file opened for appending: lines of several processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
