"""Randomized chaos for --heal (issue 21): a seed makes a schedule of failures, a job runs it, and the
invariants a user relies on are checked. Shared by tests/heal/test_heal_random.py (a few fixed seeds, in CI)
and bench/heal_chaos.py (many seeds, counted).

A schedule (``Schedule.from_seed``) picks the job (3 or 4 workers, --min-nproc 1 or 2, ddp / manual / zero2,
the torch, ring or shm all-reduce, background sharded saves) and its failures, at random moments, including
inside heals, admissions, sharded and background saves and evaluations:

- placed faults (ringtrain/testing/faults.py): a worker SIGKILLed at a point of a step (inside the ring or shm
  all-reduce, after the ledger's gather, inside a full or sharded save, in an evaluation, in the last summary)
  or of a heal (after its decision, once its group formed, right after rank 0 planned an admission);
- from outside: a worker SIGKILLed at a step, a worker SIGSTOPped past dist.timeout_s and continued later
  (cut off: it must exit having written nothing), a `ringtrain join` that is admitted, one that leaves
  (Ctrl-C) before it is.

Never more workers are lost than --nproc minus --min-nproc, and never all the launched ones (the launcher's
job lives while one of its workers does). Checked after every run (``check``): exit 0; the launcher returned;
every sample exactly once and every step once in the ledger; equal parameters on every rank; every committed
checkpoint verifies and the newest resumes; no process of the job and no /dev/shm segment of it left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ringtrain.checkpoint.manager import CheckpointManager, load_checkpoint_file
from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import verify as verify_sharded
from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from ringtrain.data.ledger import check_ledger
from ringtrain.testing.fault_plans import Fault, fault_plan
from ringtrain.testing.jobs import Job, ledger_steps, records

__all__ = ["Schedule", "Outside", "run_schedule", "check"]

STEPS_PER_EPOCH = 15  # digits: 1,437 training samples, 96 a step
TIMEOUT_S = 8  # dist.timeout_s: a stopped worker is cut off after it


@dataclass(frozen=True)
class Outside:
    """A failure caused from outside the job, when the ledger reaches ``step``."""

    kind: str
    """'kill', 'stop' (SIGSTOP, SIGCONT after dist.timeout_s + 4 s), 'join' (a joiner started with the job,
    admitted once there is room) or 'depart' (one started with the job that leaves, Ctrl-C, at ``step``)."""
    step: int
    member: int = -1
    """The launched rank to hurt (kill, stop)."""


@dataclass
class Schedule:
    seed: int
    nproc: int
    min_nproc: int
    strategy: str
    algorithm: str
    background_saves: bool
    epochs: int
    faults: list[Fault] = field(default_factory=list)
    outside: list[Outside] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.epochs * STEPS_PER_EPOCH

    def describe(self) -> str:
        placed = ", ".join(f"{f.action} member {f.member} at {f.point}"
                           + (f" step {f.step}" if f.step is not None else "")
                           + (f" generation {f.generation}" if f.generation is not None else "") for f in self.faults)
        outside = ", ".join(f"{o.kind}{'' if o.member < 0 else f' member {o.member}'} at step {o.step}"
                            for o in self.outside)
        return (f"seed {self.seed}: {self.nproc} workers, --min-nproc {self.min_nproc}, {self.strategy}/{self.algorithm}"
                f"{' background saves' if self.background_saves else ''}, {self.epochs} epochs; placed: {placed or '-'}; "
                f"outside: {outside or '-'}")

    @classmethod
    def from_seed(cls, seed: int) -> Schedule:
        rng = random.Random(seed)
        nproc = rng.choice([3, 4])
        min_nproc = rng.choice([1, 2])
        strategy = rng.choice(["ddp", "manual", "manual", "zero2"])
        algorithm = "torch" if strategy == "ddp" and rng.random() < 0.5 else rng.choice(["ring", "shm"])
        schedule = cls(seed, nproc, min_nproc, strategy, algorithm,
                       background_saves=strategy == "zero2" and rng.random() < 0.5, epochs=2)
        budget = nproc - min_nproc  # losses the job survives
        victims = list(range(1, nproc))  # launched members; member 0 is hurt by placed faults only, at most once
        rng.shuffle(victims)
        losses = rng.randint(1, budget)
        heal_points = ["heal.form", "heal.settle"]
        for loss in range(losses):
            member = victims.pop() if victims and (loss or rng.random() < 0.7) else 0
            if member == 0 and any(f.member == 0 for f in schedule.faults):
                member = victims.pop() if victims else None
            if member is None:
                break
            kind = rng.choice(["placed", "placed", "outside", "stop"])
            # A sharded job heals by reloading: not before its first checkpoint is surely committed (a background
            # save of step 5 commits a little later), else it ends in one line by design.
            step = rng.randint(11 if strategy == "zero2" else 3, schedule.steps - 3)
            if kind == "outside" and member != 0:
                schedule.outside.append(Outside("kill", step, member))
            elif kind == "stop" and member != 0:
                schedule.outside.append(Outside("stop", step, member))
            elif loss > 0 and rng.random() < 0.5:
                schedule.faults.append(Fault(rng.choice(heal_points), member=member, generation=rng.randint(1, loss)))
            else:
                schedule.faults.append(schedule._step_fault(rng, member, step))
        if strategy != "zero2":  # sharded jobs refuse joiners
            if rng.random() < 0.5:
                schedule.outside.append(Outside("depart", rng.randint(2, schedule.steps // 2)))
            if rng.random() < 0.6:
                schedule.outside.append(Outside("join", rng.randint(2, schedule.steps // 2)))
                if rng.random() < 0.5 and not any(f.member == 0 for f in schedule.faults) and losses < budget:
                    schedule.faults.append(Fault("heal.planned", member=0))  # the writer, right after it planned
        return schedule

    def _step_fault(self, rng: random.Random, member: int, step: int) -> Fault:
        points = ["ledger.gathered", "train.evaluate"]
        if self.algorithm == "ring":
            points += ["ring.step"]
        if self.algorithm == "shm":
            points += ["shm.arrive"]
        if self.strategy == "zero2":
            points += ["checkpoint.sharded.enter"]
        elif member == 0:
            points += ["checkpoint.save.commit"]
        else:
            points += ["checkpoint.save.enter"]
        point = rng.choice(points)
        if point == "train.evaluate":
            return Fault(point, member=member, step=rng.choice([STEPS_PER_EPOCH, self.steps]))
        if point.startswith("checkpoint."):
            return Fault(point, member=member, step=5 * rng.randint(2 if self.strategy == "zero2" else 1,
                                                                    self.steps // 5 - 1))
        if point in ("ring.step", "shm.arrive"):
            return Fault(point, member=member, step=step, hit=rng.randint(1, 3))
        return Fault(point, member=member, step=step)

    def overrides(self) -> list[str]:
        sets = {"train.global_batch_size": "96", "train.local_batch_size": "16", "train.lr_schedule": "constant",
                "data.ledger": "true", "monitor.log_every_steps": "1", "monitor.progress": "false",
                "monitor.eval_every_epochs": "1", "dist.timeout_s": str(TIMEOUT_S), "checkpoint.every_steps": "5",
                "train.epochs": str(self.epochs), "comm.strategy": self.strategy, "comm.algorithm": self.algorithm,
                "model.hidden_sizes": "[256,256]"}
        if self.strategy == "zero2":
            sets["checkpoint.sharded"] = "true"
            sets["checkpoint.async"] = str(self.background_saves).lower()
        return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


@dataclass
class Outcome:
    schedule: Schedule
    code: int
    stderr: str
    run_dir: Path
    fired: list[str]
    seconds: float
    leftovers: list[str] = field(default_factory=list)
    problem: str | None = None
    """What the driver saw go wrong while it ran the schedule (a job that ended early, a wait that timed out)."""


def run_schedule(schedule: Schedule, folder: Path, timeout_s: float = 300) -> Outcome:
    """Run ``schedule``'s job in ``folder`` with its failures; return what happened (``check`` judges it)."""
    run_dir = folder / "run"
    plan = fault_plan(folder, *schedule.faults)
    shm_before = _shm_segments()
    started = time.monotonic()
    joiners: list[Job] = []
    stopped: list[tuple[float, psutil.Process]] = []
    problem = None
    with Job("train", "configs/digits_mlp.toml", "--nproc", str(schedule.nproc), "--min-nproc",
             str(schedule.min_nproc), "--heal", "--run-dir", str(run_dir), *schedule.overrides(), env=plan.env) as job:
        try:
            # Joiners start with the job (a Python process takes seconds to start, a step milliseconds): they ask
            # while it is full and wait; one that departs leaves (Ctrl-C) when the ledger reaches its step.
            job.wait_for(lambda: (run_dir / "job.json").exists(), timeout=timeout_s, what="job.json")
            departing = {}
            for event in schedule.outside:
                if event.kind in ("join", "depart"):
                    joiners.append(Job("join", str(run_dir)).__enter__())
                    if event.kind == "depart":
                        departing[event] = joiners[-1]
            for event in sorted(schedule.outside, key=lambda e: e.step):
                if event.kind == "join":
                    continue
                job.wait_for(lambda: len(ledger_steps(run_dir)) >= event.step or _done(run_dir),
                             timeout=timeout_s, what=f"step {event.step}")
                if _done(run_dir):
                    break
                if event.kind == "depart":
                    joiner = departing[event]
                    # A departure is a joiner leaving before admission (its request withdrawn). One admitted already
                    # (an earlier loss made room) is a member: a Ctrl-C there stops the whole job, saved, as a
                    # Ctrl-C to any worker does (docs/fault-tolerance.md, Stopped on purpose); that is not this event.
                    if not any("joined as rank" in line for _, line in joiner.lines):
                        for proc in joiner.tree():
                            _signal(proc, signal.SIGINT)
                    continue
                worker = job.workers().get(event.member)
                if worker is None:
                    continue  # lost already (a placed fault came first)
                if event.kind == "kill":
                    _signal(worker, signal.SIGKILL)
                else:
                    _signal(worker, signal.SIGSTOP)
                    stopped.append((time.monotonic(), worker))
                _continue_stopped(stopped)
            while stopped and job.process.poll() is None:
                _continue_stopped(stopped)
                time.sleep(0.1)
            code = job.finish(timeout=timeout_s)
        except AssertionError as err:  # the job ended early or hung: judged by check() as what it is
            code = job.process.poll() if job.process.poll() is not None else -1
            problem = str(err).splitlines()[0]
        finally:
            for _, proc in stopped:
                _signal(proc, signal.SIGCONT)
            for joiner in joiners:
                try:
                    joiner.finish(timeout=60)
                except Exception:  # noqa: BLE001 - judged below by what is left running
                    pass
                joiner.__exit__(None, None, None)
        stderr = job.stderr + "".join(f"\n[joiner {n}]\n{j.stderr}" for n, j in enumerate(joiners))
        tree = job.tree()
    time.sleep(1.0)  # the kernel reaps the job's last processes
    leftovers = [f"pid {p.pid}: {' '.join(p.cmdline())[:120]}" for p in _job_processes(run_dir, tree)]
    leftovers += [f"/dev/shm/{name}" for name in sorted(_shm_segments() - shm_before)]
    return Outcome(schedule, code, stderr, run_dir, [f["point"] for f in plan.fired()], time.monotonic() - started,
                   leftovers, problem)


def check(outcome: Outcome) -> list[str]:
    """Every invariant the run broke, as lines (empty: it held them all)."""
    schedule, run_dir = outcome.schedule, outcome.run_dir
    problems = [outcome.problem] if outcome.problem else []
    if outcome.code != 0:
        problems.append(f"exit code {outcome.code}")
    try:
        done = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return [*problems, "no summary.json"]
    if done["steps"] != schedule.steps:
        problems.append(f"summary steps {done['steps']} != {schedule.steps}")
    if len(set(done["param_sha256"])) != 1:
        problems.append(f"ranks hold different parameters: {done['param_sha256']}")
    reports = check_ledger(run_dir / "ledger.jsonl")
    if len(reports) != schedule.epochs or not all(r.exactly_once and r.complete for r in reports):
        problems.append(f"the ledger does not show every sample exactly once: {reports}")
    steps = [r["step"] for r in ledger_steps(run_dir)]
    if steps != list(range(1, schedule.steps + 1)):
        problems.append("a step is missing or appears twice in the ledger")
    problems += _check_checkpoints(run_dir)
    if len(records(run_dir, "heal")) != done.get("heals"):
        problems.append(f"{len(records(run_dir, 'heal'))} heal records but summary.json counts {done.get('heals')}")
    problems += [f"left behind: {item}" for item in outcome.leftovers]
    return problems


def _check_checkpoints(run_dir: Path) -> list[str]:
    problems = []
    checkpoints = run_dir / "checkpoints"
    manager = CheckpointManager(checkpoints, is_writer=False)
    full = [p for p in manager.checkpoints() if p.with_name(p.name.removesuffix(".pt") + ".manifest.json").exists()]
    for path in full:
        try:
            load_checkpoint_file(path)
        except Exception as err:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"committed checkpoint {path.name} does not load: {err}")
    sharded = committed_sharded(checkpoints)
    for path in sharded:
        try:
            verify_sharded(path)
        except Exception as err:  # noqa: BLE001
            problems.append(f"committed checkpoint {path.name} does not verify: {err}")
    if not full and not sharded:
        problems.append("no committed checkpoint")
    return problems


def _continue_stopped(stopped: list[tuple[float, psutil.Process]]) -> None:
    """SIGCONT each stopped worker dist.timeout_s + 4 s after it stopped: cut off by then, it must find the job
    moved on, write nothing and exit (unless the job ended first: the launcher then stops it)."""
    for entry in list(stopped):
        since, proc = entry
        if time.monotonic() - since > TIMEOUT_S + 4:
            _signal(proc, signal.SIGCONT)
            stopped.remove(entry)


def _done(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def _signal(proc: psutil.Process, number: int) -> None:
    try:
        proc.send_signal(number)
    except psutil.NoSuchProcess:
        pass


def _job_processes(run_dir: Path, tree: list[psutil.Process]) -> list[psutil.Process]:
    """Processes of the job still alive: its tree as seen at the end, and anything naming its run directory."""
    found = {p.pid: p for p in tree if _alive(p)}
    for proc in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(proc.info["cmdline"] or []) and _alive(proc) and proc.pid != os.getpid():
            found[proc.pid] = proc
    return list(found.values())


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _shm_segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    except FileNotFoundError:
        return set()
