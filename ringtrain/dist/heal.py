"""Healing in place, the membership half: who is left after a failure, and their new process group.

Under ``--heal`` every worker is a *member* with a stable id (the rank it started with, or the id it was
admitted with) and the job runs in *generations*: generation 0 is the group the launcher started; each
heal makes the next one, with the members that are left, ranked in the order of their ids. Membership
lives in the job store (the launcher's store, which outlives every worker), never in torch's rendezvous,
so no agent restarts anybody:

    (all under heal/<attempt>/: one namespace per start of the worker group)
    heal/<g>/failed          the first member that saw generation g fail says so (member, step)
    heal/<g>/arrived/<id>    each survivor of g: "I am here" (and the step it has applied)
    heal/<g>/decision        the members of generation g + 1, written once (compare_set: first writer wins)
    heal/generation          the newest generation (the fence: a member of an older one must not write)
    heal/<g+1>/pg/...        the new Gloo group's own keys
    join/requests, joined/<id>, heal/<g>/admit   a worker that joins (``request_join``): rank 0 schedules
                             its admission after the next step, every member regroups with it there

Agreement: a survivor proposes the members that arrived once every member of g has either arrived or
gone silent (its heartbeat, a counter the member's heartbeat thread bumps every 0.1 s, stood still for
0.5 s: dead or stopped); ``compare_set`` makes the first proposal the decision for everyone. A member that
arrives after the decision and is not in it was cut off: it is *fenced* (``Fenced``) and must write
nothing. A live member cannot be left out: it beats, so nobody proposes before it arrives.

    membership = Membership(job_store, Generation(0, (0, 1, 2), member=1), timeout_s=120)
    membership.publish_failure(step=37)
    abandon_group()                                     # the broken group: never waited on again
    generation = membership.agree(applied_step=36)      # e.g. Generation(1, (0, 1), member=1): rank 1 of 2
    init_generation_group(membership, generation, timeout_s=120)
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ringtrain.comm import shm_group
from ringtrain.dist.jobstore import JobStore, NullJobStore
from ringtrain.dist.sockets import forget_group_sockets, recording_group_sockets, shutdown_group_sockets
from ringtrain.errors import RingtrainError

__all__ = [
    "Generation", "Membership", "Fenced", "HealFailed", "abandon_group", "init_generation_group", "request_join",
    "HEAL_BEAT_S", "SILENT_AFTER_S", "JOINER_BASE",
]

HEAL_BEAT_S = 0.1
"""Heartbeat interval under --heal: a lost member is told from a live one within SILENT_AFTER_S."""
SILENT_AFTER_S = 0.5
"""A member whose heartbeat stood still this long is dead or stopped (5 beats)."""
_POLL_S = 0.01
_FRESH_S = 0.5
"""A fence read that took longer is read again (see ``check_fence``)."""
JOINER_BASE = 1000
"""Member ids of joining workers start above this (the launched ones are their first ranks), so a joiner
ranks after every worker that was there before it."""


class HealFailed(RingtrainError):
    """Healing could not continue (too few workers left, or the survivors could not regroup)."""

    exit_code = 1


class Fenced(RingtrainError):
    """This worker was cut off: the group moved on to a newer generation without it."""

    exit_code = 1


@dataclass(frozen=True)
class Generation:
    """One generation of the job: its number and its members (ids, in rank order), and this worker's id."""

    number: int
    members: tuple[int, ...]
    member: int

    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @property
    def world_size(self) -> int:
        return len(self.members)


class Membership:
    """This worker's view of the job's generations, kept in the job store (see the module's docstring)."""

    def __init__(self, job_store: NullJobStore, generation: Generation, timeout_s: float,
                 silent_after_s: float = SILENT_AFTER_S, attempt: str = "0"):
        if not isinstance(job_store, JobStore):
            raise HealFailed("dist.heal needs the job store that `ringtrain train --heal` (or ringtrain run --heal) "
                             "hosts; start the job with --nproc N --min-nproc M --heal")
        self.job_store = job_store
        # One namespace per start of the worker group (a restart or a join through the agents starts over at
        # generation 0): keys of an earlier attempt never fence this one.
        self.store = dist.PrefixStore(f"heal/{attempt}/", job_store.store)
        self.generation = generation
        self.timeout_s = timeout_s
        self.silent_after_s = silent_after_s

    # --- the fence -----------------------------------------------------------------------------------
    def newest(self) -> int:
        """The job's newest generation (0 before the first heal)."""
        return int(self.store.get("generation")) if self.store.check(["generation"]) else 0

    def check_fence(self) -> None:
        """Raise Fenced when the job moved on to a newer generation than this worker's (call before every
        write into the run directory: a cut-off worker that resumes must not act for the group).

        A read that took long may be stale: the worker may have been stopped (SIGSTOP, a long stall) while the
        store's answer, sent before a heal, sat in its socket. So the read is repeated until one is quick, and
        the write that follows acts on an answer at most ``_FRESH_S`` old. (The appends a worker stopped after
        its check would still make go into files a new writer replaced at its start: ``take_over``.)"""
        for _ in range(10):  # a store that is slow every time: the last answer, as without the check
            started = time.monotonic()
            newest = self.newest()
            if time.monotonic() - started < _FRESH_S:
                break
        if newest != self.generation.number:
            raise Fenced(self._fenced_line(newest))

    def _fenced_line(self, newest: int) -> str:
        return (f"member {self.generation.member} was cut off: the job healed to generation {newest} without it "
                f"(this worker was in generation {self.generation.number}); it writes nothing and exits")

    # --- one heal ------------------------------------------------------------------------------------
    def publish_failure(self, step: int) -> None:
        """Say that this generation failed (first writer wins), so peers learn of it from the store."""
        self.store.compare_set(f"{self.generation.number}/failed", "", f"{self.generation.member} {step}")

    def failure_published(self) -> bool:
        return self.store.check([f"{self.generation.number}/failed"])

    def agree(self, applied_step: int) -> Generation:
        """Arrive, wait until every member of this generation arrived or went silent, and return the next
        generation everyone agreed on (Fenced if it does not include this worker)."""
        number, me = self.generation.number, self.generation.member
        prefix = f"{number}"
        self.store.set(f"{prefix}/arrived/{me}", str(applied_step))
        deadline = time.monotonic() + self.timeout_s
        last_beat: dict[int, tuple[int | None, float]] = {}
        decision = f"{prefix}/decision"
        while not self.store.check([decision]):
            arrived = [m for m in self.generation.members if self.store.check([f"{prefix}/arrived/{m}"])]
            now = time.monotonic()
            beats = self.job_store.beats_of([m for m in self.generation.members if m not in arrived])
            pending = []
            for m, count in beats.items():
                previous, since = last_beat.get(m, (None, now))
                if count != previous:  # it beats (or we just started watching): wait for it
                    last_beat[m] = (count, now)
                    pending.append(m)
                elif now - since < self.silent_after_s:
                    pending.append(m)
            # A member that never beat counts as silent; after timeout_s the arrived ones go on alone.
            if not pending or now > deadline:
                proposal = json.dumps({"generation": number + 1, "members": sorted(arrived)})
                self.store.compare_set(decision, "", proposal)
                break
            time.sleep(_POLL_S)
        members = tuple(json.loads(self.store.get(decision))["members"])
        if me not in members:
            raise Fenced(self._fenced_line(number + 1))
        self.store.set("generation", str(number + 1))
        self.generation = Generation(number + 1, members, me)
        return self.generation

    # --- admitting a worker (``ringtrain join``) at a step boundary ---------------------------------------
    def publish_attempt(self, attempt: str) -> None:
        """Rank 0 of generation 0: tell a joining worker which namespace the running group uses."""
        self.job_store.store.set("heal/current", attempt)

    def pending_joiners(self) -> list[int]:
        """Ids of workers that asked to join and were not admitted yet."""
        requested, admitted = self.store.add("join/requests", 0), self.store.add("join/admitted", 0)
        return [JOINER_BASE + n for n in range(admitted + 1, requested + 1)]

    def schedule_admission(self, after_step: int, joiners: list[int]) -> None:
        """Rank 0: admit ``joiners`` once step ``after_step`` is complete. Written before rank 0 starts the
        step before it, so every rank reads it by then: none can finish that step without rank 0."""
        plan = json.dumps({"after_step": after_step, "joiners": joiners})
        self.store.compare_set(f"{self.generation.number}/admit", "", plan)

    def admission(self) -> tuple[int, list[int]] | None:
        """(after_step, joiners) scheduled for this generation, if any."""
        key = f"{self.generation.number}/admit"
        if not self.store.check([key]):
            return None
        plan = json.loads(self.store.get(key))
        return plan["after_step"], plan["joiners"]

    def admit(self, joiners: list[int]) -> Generation:
        """Every member: the next generation is this one plus ``joiners`` (who learn it from joined/<id>)."""
        number, me = self.generation.number, self.generation.member
        members = tuple(sorted({*self.generation.members, *joiners}))
        self.store.compare_set(f"{number}/decision", "", json.dumps({"generation": number + 1, "members": members}))
        members = tuple(json.loads(self.store.get(f"{number}/decision"))["members"])
        if self.generation.rank == 0:
            self.store.add("join/admitted", len(joiners))
            for joiner in joiners:
                self.store.set(f"joined/{joiner}", str(number + 1))
        self.store.set("generation", str(number + 1))
        self.generation = Generation(number + 1, members, me)
        return self.generation

    def arrived_steps(self, generation: int) -> dict[int, int]:
        """The step each survivor of ``generation`` had applied when it arrived."""
        prefix = f"{generation}/arrived"
        members = self.generation.members if generation + 1 == self.generation.number else ()
        return {m: int(self.store.get(f"{prefix}/{m}")) for m in members if self.store.check([f"{prefix}/{m}"])}


def request_join(job_store: NullJobStore, timeout_s: float, wait_s: float = 600.0) -> tuple[Membership, Generation]:
    """A worker that joins a running --heal job: ask, and wait until the members admit it at a step boundary.
    Returns its membership and the generation it joins (its rank and the group's size)."""
    if not isinstance(job_store, JobStore):
        raise HealFailed("ringtrain join: the job store of the running job cannot be reached")
    deadline = time.monotonic() + wait_s
    while not job_store.store.check(["heal/current"]):
        if time.monotonic() > deadline:
            raise HealFailed("ringtrain join: the running job never published its membership (is it a --heal job?)")
        time.sleep(0.05)
    attempt = job_store.store.get("heal/current").decode()
    membership = Membership(job_store, Generation(-1, (), member=-1), timeout_s, attempt=attempt)
    member = JOINER_BASE + membership.store.add("join/requests", 1)
    print(f"ringtrain: asked to join as member {member}; waiting for the running workers to admit it at a step "
          "boundary (while the job has --nproc workers, until one is lost)", file=sys.stderr, flush=True)
    while not membership.store.check([f"joined/{member}"]):
        if time.monotonic() > deadline:
            raise HealFailed(f"ringtrain join: not admitted within {wait_s:g} s (the job may be finishing)")
        time.sleep(0.02)
    number = int(membership.store.get(f"joined/{member}"))
    members = tuple(json.loads(membership.store.get(f"{number - 1}/decision"))["members"])
    membership.generation = Generation(number, members, member)
    return membership, membership.generation


def abandon_group(failed: bool = True) -> None:
    """Leave the default group without waiting on it. A ``failed`` group's collectives failed, so nothing of
    it is waited for again: its TCP sockets are shut down first (``sockets.py``), which tells a peer still
    blocked in one of its collectives (on a live rank) that the group is gone at once, not after timeout_s,
    and makes a collective of this rank still in flight on it (the step agreement, a DDP all-reduce) fail,
    so the destroy returns at once instead of waiting for it until timeout_s. (``failed=False``: a healthy
    group left at a step boundary to admit a joiner, with nothing in flight: closed the ordinary way.)

    Objects that hung off the group (a DDP wrapper's reducer, whose autograd hooks would otherwise fire on
    the next backward) must be dropped by the caller first; the collection here frees them, so the group is
    destroyed here, never later in a garbage collection. Its shared-memory workspace
    (``comm.algorithm = "shm"``) goes too, with any segment a dead peer left named in /dev/shm."""
    if failed:
        shutdown_group_sockets()
    forget_group_sockets()
    gc.collect()
    if dist.is_initialized():
        shm_group.destroy(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass  # already half torn down by the failure: nothing left to close


def init_generation_group(membership: Membership, generation: Generation, timeout_s: float, backend: str) -> None:
    """The new default process group of ``generation``: its members, ranked by id, meeting in the job store
    under heal/<g>/pg/ (a fresh prefix per generation, so keys of a failed attempt never mix in)."""
    store = dist.PrefixStore(f"{generation.number}/pg/", membership.store)
    shm_group.set_name_scope(f"g{generation.number}")  # its shm segments, if any, are named for it
    with recording_group_sockets(store):  # abandon_group shuts them down if this generation fails
        dist.init_process_group(backend, store=store, rank=generation.rank, world_size=generation.world_size,
                                timeout=timedelta(seconds=timeout_s))
