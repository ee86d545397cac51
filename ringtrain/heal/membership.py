"""Who is in the job: members, generations, the agreement after a failure, joining, the fence.

Under ``--heal`` every worker is a *member* with a stable id (the rank it was launched with, or 1000 + n for
the n-th worker that asked to join) and the job runs in *generations*: generation 0 is the group the
launcher started; each heal or admission makes the next one, its members ranked in the order of their ids.
Membership lives in the job store (the launcher's store, which outlives every worker), never in torch's
rendezvous, so no agent restarts anybody. Keys, under ``heal/<attempt>/`` (one namespace per start of the
worker group):

    who/<id>                 the member's Registration (host, pid, start time: liveness.py)
    <g>/failed               the first member that saw generation g fail says so (member, step)
    <g>/arrived/<id>         each survivor of g: "I am here" (and the step it has applied)
    <g>/decision             the members of generation g + 1, written once (compare_set: first writer wins)
    <g>/ready/<id>           a member of g is about to form g's process group
    <g>/pg/...               generation g's Gloo group
    <g>/admit                rank 0's plan to admit joiners after a step (``schedule_admission``)
    generation               the newest generation (the fence: a member of an older one must not write)
    join/requests            how many workers asked to join; join/withdrawn/<id>, joined/<id>
    finished/<id>            the member ran the job to its end (summary written)
    error                    a member failed on its own (not a lost peer): the others stop, not heal
and job-wide, under ``heal/``: ``exited/<host>/<pid>`` (liveness.ExitReporter), ``done`` (the job finished:
the launcher stops waiting for cut-off workers, a waiting joiner gives up).

Agreement (``agree``): a survivor arrives, then waits until every member of the failed generation has
arrived, finished, or is *lost*: dead for certain (its process is gone: liveness.py), withdrawn, or hung (its
heartbeat stood still for ``hang_after_s``). Then any of them proposes the arrived set with ``compare_set``;
the first proposal is the decision for everyone, so survivors cannot disagree, and a live member cannot be
left out (nobody proposes before it arrives, up to ``timeout_s``). A member that is not in the decision was
cut off: it is *fenced* (``Fenced``) and must write nothing.

Forming (``form``): every member of a decided generation says it is ready, and waits for the others; a member
lost meanwhile makes the generation fail before its group exists (``GenerationFailed``), so the others agree
again instead of waiting out a process-group timeout for it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ringtrain.group.jobstore import JobStore, NullJobStore
from ringtrain.group.sockets import recording_group_sockets
from ringtrain.errors import RingtrainError
from ringtrain.heal.liveness import Registration, exit_key, finished_key

__all__ = ["Generation", "Membership", "job_keys", "Fenced", "HealFailed", "GenerationFailed", "MemberFailed", "Spared",
           "request_join", "whole_replicas", "admit_whole_replicas", "HEAL_BEAT_S", "JOINER_BASE"]

HEAL_BEAT_S = 0.1
"""Heartbeat interval under --heal (the flight-recorder watchdog and the hang clock tick with it)."""
JOINER_BASE = 1000
"""Member ids of joining workers start above this (the launched ones are their first ranks), so a joiner
ranks after every worker that was there before it."""
_POLL_S = 0.01
_FRESH_S = 0.5
"""A fence read that took longer is read again (see ``check_fence``)."""


class HealFailed(RingtrainError):
    """Healing could not continue (too few workers left, or the survivors could not regroup)."""

    exit_code = 1


class Fenced(RingtrainError):
    """This worker was cut off: the group moved on to a newer generation without it."""

    exit_code = 1


class MemberFailed(RingtrainError):
    """A member of the job failed on its own (an error in the model, the data, a file), not by being lost:
    healing would meet the same error again, so every member stops with its line."""

    exit_code = 1


class Spared(RingtrainError):
    """This worker is alive, but a peer of its model-parallel replica (its tp/cp/pp group) was lost: the replica
    cannot train without its part, so the survivors went on without the whole replica and this worker leaves
    the job cleanly (exit 0)."""

    exit_code = 0


class JoinInterrupted(RingtrainError):
    """Ctrl-C while waiting to be admitted: the request is withdrawn."""

    exit_code = 130


class GenerationFailed(Exception):
    """A generation failed before its process group formed (a member lost while the others waited for it)."""


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


def job_keys(job_store: JobStore) -> dist.Store:
    """The job-wide keys of healing (``exited/<host>/<pid>``, ``done``), the same for the workers, their launcher
    and ``ringtrain join`` (a PrefixStore joins its prefix and a key with '/': written and read through this
    one function, the keys cannot drift apart)."""
    return dist.PrefixStore("heal", job_store.store)


class Membership:
    """This worker's view of the job's generations, kept in the job store (see the module's docstring)."""

    def __init__(self, job_store: NullJobStore, generation: Generation, timeout_s: float,
                 hang_after_s: float | None = None, attempt: str = "0"):
        if not isinstance(job_store, JobStore):
            raise HealFailed("healing needs the job store that `ringtrain train --heal` (or ringtrain run --heal) "
                             "hosts; start the job with --nproc N --min-nproc M --heal")
        self.job_store = job_store
        # One namespace per start of the worker group (a restart or a join through the agents starts over at
        # generation 0): keys of an earlier attempt never fence this one.
        self.store = dist.PrefixStore(f"heal/{attempt}/", job_store.store)
        self.job = job_keys(job_store)
        self.generation = generation
        self.timeout_s = timeout_s
        self.hang_after_s = timeout_s if hang_after_s is None else hang_after_s
        """A member whose heartbeat stood still this long is hung (taken for lost); a dead one is known at once."""
        self._registrations: dict[int, Registration] = {}

    # --- who is alive -------------------------------------------------------------------------------
    def register(self) -> None:
        """Say who this member is (host, pid, start time), so that peers can tell when it is dead."""
        self.store.set(f"who/{self.generation.member}", Registration.mine().to_json())

    def registration(self, member: int) -> Registration | None:
        found = self._registrations.get(member)
        if found is None and self.store.check([f"who/{member}"]):
            found = self._registrations[member] = Registration.from_json(self.store.get(f"who/{member}"))
        return found

    def dead(self, member: int) -> bool:
        """True when ``member``'s process is known to have exited (never a guess from silence)."""
        registration = self.registration(member)
        if registration is None:
            return False
        return registration.alive(lambda host, pid: self.job.check([exit_key(host, pid)])) is False

    def withdrawn(self, member: int) -> bool:
        return self.store.check([f"join/withdrawn/{member}"])

    def hung(self, member: int) -> bool:
        """True when ``member``'s heartbeat stood still for ``hang_after_s`` (stopped, or hung)."""
        times = self.job_store.beat_times_of([member])
        if member not in times:
            registration = self.registration(member)
            # Never beat: count from its registration (joiners beat from their request on).
            since = registration.start if registration is not None else None
        else:
            since = times[member]
        return since is not None and time.time() - since >= self.hang_after_s

    def lost(self, member: int) -> bool:
        return self.dead(member) or self.withdrawn(member) or self.hung(member)

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
        if newest > self.generation.number and not self._carried_to(newest):
            raise Fenced(self._fenced_line(newest))

    def _carried_to(self, newest: int) -> bool:
        """True when every decision from this worker's generation up to ``newest`` keeps it: the others moved on
        through an admission this worker has not reached yet, not without it. An admission is decided at a step
        boundary by whichever member reaches it first; the writer, still writing the step before it (its ledger
        line, its metrics), reads a newer generation than its own, and is one of its members (seen in CI: a live
        writer that took that for being cut off). A failure's decision holds only members that arrived in
        ``agree``, which this worker has not, so a heal without it is still found."""
        me = self.generation.member
        for number in range(self.generation.number, newest):
            key = f"{number}/decision"
            if not self.store.check([key]) or me not in json.loads(self.store.get(key))["members"]:
                return False
        return True

    def _fenced_line(self, newest: int) -> str:
        return (f"member {self.generation.member} was cut off: the job healed to generation {newest} without it "
                f"(this worker was in generation {self.generation.number}); it writes nothing and exits")

    # --- one failure -----------------------------------------------------------------------------------
    def publish_failure(self, step: int) -> None:
        """Say that this generation failed (first writer wins), so peers learn of it from the store."""
        self.store.compare_set(f"{self.generation.number}/failed", "", f"{self.generation.member} {step}")

    def failure_published(self) -> bool:
        return self.store.check([f"{self.generation.number}/failed"])

    def publish_error(self, line: str) -> None:
        """This member failed on its own (see ``MemberFailed``): the others stop instead of healing."""
        self.store.compare_set("error", "", line)

    def raise_if_error(self) -> None:
        if self.store.check(["error"]):
            raise MemberFailed(self.store.get("error").decode())

    def agree(self, applied_step: int, replica_size: int = 1) -> tuple[Generation, bool]:
        """Arrive, wait until every member of this generation arrived, finished or was lost, and return the next
        generation everyone agreed on, and whether a member finished the job (Fenced if this worker is not in
        the next generation). ``replica_size`` > 1 (a split model: tp x cp x pp ranks, consecutive): a replica
        goes on only whole, so the arrived members of a replica that lost one are left out (``Spared``)."""
        number, me = self.generation.number, self.generation.member
        prefix = f"{number}"
        self.store.set(f"{prefix}/arrived/{me}", str(applied_step))
        deadline = time.monotonic() + self.timeout_s
        decision = f"{prefix}/decision"
        while not self.store.check([decision]):
            self.raise_if_error()
            arrived = [m for m in self.generation.members if self.store.check([f"{prefix}/arrived/{m}"])]
            pending = [m for m in self.generation.members
                       if m not in arrived and not self.finished(m) and not self.lost(m)]
            # A live member that neither arrives nor hangs (beats) is waited for; after timeout_s the arrived
            # ones go on alone (it is stuck somewhere no failure reaches), and it is fenced when it arrives.
            if not pending or time.monotonic() > deadline:
                kept = whole_replicas(self.generation.members, set(arrived), replica_size)
                proposal = json.dumps({"generation": number + 1, "members": kept,
                                       "spared": sorted(set(arrived) - set(kept))})
                self.store.compare_set(decision, "", proposal)
                break
            time.sleep(_POLL_S)
        decided = json.loads(self.store.get(decision))
        members = tuple(decided["members"])
        finished = any(self.finished(m) for m in self.generation.members)
        if me in decided.get("spared", ()):
            if not members:
                raise HealFailed(f"generation {number}: a worker of every model-parallel replica (of {replica_size} "
                                 "workers) was lost, so no whole replica remains; continue with --resume")
            raise Spared(f"member {me}: a worker of its model-parallel replica was lost, so the replica left the job; "
                         f"the other {len(members)} workers go on (generation {number + 1}) and this one exits")
        if me not in members:
            raise Fenced(self._fenced_line(number + 1))
        self._advance(Generation(number + 1, members, me))
        return self.generation, finished

    def arrived_steps(self, generation: int) -> dict[int, int]:
        """The step each survivor of ``generation`` had applied when it arrived (members of the next one)."""
        prefix = f"{generation}/arrived"
        return {m: int(self.store.get(f"{prefix}/{m}")) for m in self.generation.members
                if self.store.check([f"{prefix}/{m}"])}

    def _advance(self, generation: Generation) -> None:
        self.generation = generation
        # Never backwards: a slow member adopting an old decision must not unfence a newer generation's writers.
        current = self.newest()
        if generation.number > current:
            self.store.compare_set("generation", str(current) if self.store.check(["generation"]) else "",
                                   str(generation.number))

    # --- forming a generation's group ----------------------------------------------------------------
    def form(self, backend: str) -> None:
        """Wait until every member of the current generation is ready, then init its process group. Raises
        GenerationFailed when a member is lost before that (or a member saw the generation fail already)."""
        generation = self.generation
        number = generation.number
        self.store.set(f"{number}/ready/{generation.member}", "1")
        while True:
            self.raise_if_error()
            if self.failure_published():
                raise GenerationFailed(f"generation {number} failed before its group formed")
            missing = [m for m in generation.members if not self.store.check([f"{number}/ready/{m}"])]
            if not missing:
                break
            lost = [m for m in missing if self.lost(m)]
            if lost:
                raise GenerationFailed(f"member{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} of generation "
                                       f"{number} lost before its group formed")
            time.sleep(_POLL_S)
        store = dist.PrefixStore(f"{number}/pg/", self.store)
        from ringtrain.comm import shm_group  # here: heal sits above comm, and most members never form twice

        shm_group.set_name_scope(f"g{number}")  # its shm segments, if any, are named for it
        with recording_group_sockets(store):  # abandon_group shuts them down if this generation fails
            dist.init_process_group(backend, store=store, rank=generation.rank, world_size=generation.world_size,
                                    timeout=timedelta(seconds=self.timeout_s))

    # --- finishing -------------------------------------------------------------------------------------
    def mark_finished(self) -> None:
        """This member ran the job to its end; with every member of its generation done, the job is done."""
        self.store.set(f"finished/{self.generation.member}", str(self.generation.number))
        me = Registration.mine()
        self.job.set(finished_key(me.host, me.pid), "1")  # the launcher does not stop a worker that is exiting
        if self.generation.rank == 0:
            self.job.set("done", str(self.generation.number))

    def finished(self, member: int) -> bool:
        return self.store.check([f"finished/{member}"])

    # --- admitting a worker (``ringtrain join``) at a step boundary ---------------------------------------
    def publish_attempt(self, attempt: str) -> None:
        """Rank 0 of generation 0: tell a joining worker which namespace the running group uses."""
        self.job_store.store.set("heal/current", attempt)

    def join_requests(self) -> int:
        return self.store.add("join/requests", 0)

    def pending_joiners(self) -> tuple[list[int], int]:
        """Ids of workers that asked to join, are still there and were not admitted yet, and how many asked but
        did not register yet (derived from the store every time, so a request scheduled by a generation that
        then failed is found again by the next)."""
        ids = [JOINER_BASE + n for n in range(1, self.join_requests() + 1)]
        waiting = [m for m in ids if not self.store.check([f"joined/{m}"]) and not self.withdrawn(m)]
        unregistered = [m for m in waiting if self.registration(m) is None]
        return [m for m in waiting if m not in unregistered and not self.dead(m)], len(unregistered)

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
        for joiner in joiners:  # every member says so: the joiner learns it even if rank 0 is lost right here
            self.store.set(f"joined/{joiner}", str(number + 1))
        self._advance(Generation(number + 1, members, me))
        return self.generation


def whole_replicas(members: tuple[int, ...], present: set[int], replica_size: int) -> list[int]:
    """The members of ``members`` (in rank order, replicas of ``replica_size`` consecutive ranks) whose whole
    replica is ``present``, sorted: a replica that lost a member leaves with it."""
    kept = []
    for start in range(0, len(members), replica_size):
        replica = members[start:start + replica_size]
        if all(m in present for m in replica):
            kept.extend(replica)
    return sorted(kept)


def admit_whole_replicas(pending: list[int], replica_size: int, room: int) -> tuple[list[int], int]:
    """The joiners to admit now out of ``pending`` (in the order they asked), and how many more the next
    replica still needs. A split model (``replica_size`` = tp x cp x pp ranks) takes joiners only as whole
    replicas: they are held until ``replica_size`` of them are there, then admitted together, as many whole
    replicas as ``room`` (workers the job may still take) allows; a replica that lacks a worker waits (0: none
    waits for more, every joiner is admitted or there is no room for another replica).

        admit_whole_replicas([1001], 2, room=2)        # ([], 1): waiting for 1 more
        admit_whole_replicas([1001, 1002], 2, room=2)  # ([1001, 1002], 0)
    """
    fits = min(len(pending), max(room, 0)) // replica_size * replica_size
    left = len(pending) - fits
    has_room = room - fits >= replica_size
    missing = (replica_size - left % replica_size) % replica_size if left and has_room else 0
    return pending[:fits], missing


def request_join(job_store: NullJobStore, timeout_s: float, wait_s: float = 600.0,
                 on_member: "callable | None" = None) -> tuple[Membership, Generation]:
    """A worker that joins a running --heal job: ask, and wait until the members admit it at a step boundary.
    Returns its membership and the generation it joins (its rank and the group's size). ``on_member(id)`` is
    called as soon as the worker has its member id (it starts the heartbeat: a joiner beats while it waits).
    Leaving before admission (an error, Ctrl-C) withdraws the request, so the job never waits for it."""
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
    membership.generation = Generation(-1, (), member)
    try:
        membership.register()
        if on_member is not None:
            on_member(member)
        print(f"ringtrain: asked to join as member {member}; waiting for the running workers to admit it at a step "
              "boundary (while the job has --nproc workers, until one is lost)", file=sys.stderr, flush=True)
        while not membership.store.check([f"joined/{member}"]):
            if membership.job.check(["done"]):
                raise HealFailed("ringtrain join: the job finished before it admitted this worker; nothing to join")
            membership.raise_if_error()
            if time.monotonic() > deadline:
                raise HealFailed(f"ringtrain join: not admitted within {wait_s:g} s (the job may be finishing)")
            time.sleep(0.02)
    except BaseException as err:
        try:
            membership.store.set(f"join/withdrawn/{member}", "1")  # the members must not wait for a worker that left
            # A set is sent without a reply: it "succeeds" into the socket of a store that has already gone. The
            # check waits for the store's answer, so "withdrawn" below is true (seen in CI: a killed store, a set
            # that returned, and a message that said the request was withdrawn).
            membership.store.check([f"join/withdrawn/{member}"])
        except (RuntimeError, dist.DistError):
            if isinstance(err, KeyboardInterrupt):  # Ctrl-C is what the user did: exit 130 whether or not the job is gone
                raise JoinInterrupted(f"ringtrain join: interrupted before the job admitted member {member} (the job "
                                      "had ended)") from None
            raise HealFailed("ringtrain join: the job ended (its job store went away) before it admitted this "
                             "worker; nothing to join") from None
        if isinstance(err, KeyboardInterrupt):
            raise JoinInterrupted(f"ringtrain join: interrupted before the job admitted member {member}; its request "
                                  "was withdrawn") from None
        raise
    number = int(membership.store.get(f"joined/{member}"))
    members = tuple(json.loads(membership.store.get(f"{number - 1}/decision"))["members"])
    membership.generation = Generation(number, members, member)
    return membership, membership.generation
