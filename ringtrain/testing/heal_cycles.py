"""Repeated failures under --heal, as issue 12's proof puts it: a worker SIGKILLed every few steps, again and
again, while `ringtrain join` brings workers back. Shared by tests/heal/test_heal.py (five kills in one
run) and bench/heal_recovery.py (``--kills K --join``, many runs, the recovery times' median and worst).

    with Job("train", CONFIG, "--nproc", "3", "--min-nproc", "2", "--heal", "--run-dir", str(run_dir)) as job:
        joiners = kill_and_join(job, run_dir, kills=5, steps_between=3, join=True)
        assert job.finish() == 0 and all(j.finish() == 0 for j in joiners)

Each kill waits for the group to be whole again first (the previous heal recorded and, with ``join``, the
joiner admitted, then ``steps_between`` steps trained at full size), so no kill takes the group below
--min-nproc. Joiners are started ahead (``ready_joiners`` waiting at a time), so an admission does not
wait for a Python process to start; every joiner started is admitted (one per kill but the last).
With ``hold=True`` the job's workers hold themselves early (a ``stop`` fault on each, e.g. at
``ledger.gathered`` of step 2): every joiner starts and asks while they are stopped, then they are let go, so
the job needs only the steps its kills and joins take, however slowly a joiner starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import psutil

from ringtrain.testing.jobs import Job, ledger_steps, records

__all__ = ["kill_and_join", "worker_of"]

STARTUP_S = 300
"""How long a joiner may take to start (a Python process importing torch): beside six busy processes and other
tests' jobs (load 15 on two cores) it took more than 90 s. How fast it starts is not what these tests test."""


def worker_of(joiner: Job) -> psutil.Process | None:
    """The training worker a `ringtrain join` command started (None before it started or after it ended)."""
    for proc in joiner.tree()[1:]:
        try:
            if joiner.worker_command in " ".join(proc.cmdline()) and _alive(proc):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def kill_and_join(job: Job, run_dir: Path, kills: int, steps_between: int, join: bool = True,
                  ready_joiners: int = 4, victims: Sequence[str] | None = None, timeout_s: float = 300,
                  hold: bool = False) -> list[Job]:
    """SIGKILL ``kills`` workers of ``job`` one after another; with ``join``, a `ringtrain join` worker is
    admitted after every kill but the last. ``victims`` names each kill's target: "launched" (a worker the
    launcher started, not rank 0), "joiner" (an admitted joiner, the earliest), "writer" (the launched rank 0,
    which writes the run directory: another worker takes over). By default launched workers and joiners alternate and
    the writer is spared. The launcher hosts the job store: it (and with it the job) ends when the last
    worker it launched ends, so at least one launched worker must survive. Returns the joiners' Jobs (the
    caller finishes them; killed on exit like the job's own processes). ``hold``: the job's workers stop
    themselves (the caller's fault plan) and wait there until every joiner wanted has asked (see above)."""
    joins_wanted = kills - 1 if join else 0
    joiners: list[Job] = []

    def start_joiners() -> None:
        waiting = len(joiners) - len(records(run_dir, "join"))
        while len(joiners) < joins_wanted and waiting < ready_joiners:
            joiners.append(Job("join", str(run_dir), worker_command=job.worker_command).__enter__())
            waiting += 1

    if hold:
        # Every launched worker stopped at its fault point (none inside a collective a peer waits in), so the
        # hold may last as long as the joiners take to start: no timeout runs meanwhile.
        job.wait_for(lambda: job.held() == len(job.workers()) > 0, what="the workers to hold")  # Job's wait: 600 s
        ready_joiners = joins_wanted
    if joins_wanted:
        job.wait_for(lambda: (run_dir / "job.json").exists(), what="job.json")
        start_joiners()
        # Every joiner started ahead has asked to join before the first kill (none is late for its turn).
        job.wait_for(lambda: all("asked to join" in j.stderr for j in joiners), timeout=STARTUP_S,
                     what="the joiners to ask")
    if hold:
        job.resume_workers()
    killed: list[str] = []  # what each kill hit, for the failure message
    try:
        job.wait_for(lambda: ledger_steps(run_dir), timeout=timeout_s, what="step 1")
        agents = [p for p in job.tree() if "--spec" in _cmdline(p)]  # the launcher's own: one per worker asked
        first = ledger_steps(run_dir)[0]["world_size"]
        assert first == len(agents), f"the job began with {first} of the {len(agents)} workers it launched"
        for kill in range(kills):
            target = len(ledger_steps(run_dir)) + steps_between
            job.wait_for(lambda: len(ledger_steps(run_dir)) >= target, timeout=timeout_s, what=f"step {target}")
            kind = victims[kill] if victims else ("launched", "joiner")[kill % 2]
            victim = _victim(job, joiners, kind)
            killed.append(f"kill {kill + 1} ({kind}) at step {len(ledger_steps(run_dir))}: pid {victim.pid}, "
                          f"{_who(job, joiners, victim)}")
            victim.kill()
            job.wait_for(lambda: len(records(run_dir, "heal")) > kill, timeout=timeout_s, what=f"heal {kill + 1}")
            if kill < joins_wanted:
                # A joiner started after the previous join may still be importing torch.
                job.wait_for(lambda: len(records(run_dir, "join")) > kill, timeout=STARTUP_S, what=f"join {kill + 1}")
                start_joiners()
    except AssertionError as err:
        logs = "\n".join([*killed, *(f"[joiner {n}]\n{j.stderr}" for n, j in enumerate(joiners))])
        for joiner in joiners:
            joiner.__exit__(None, None, None)
        raise AssertionError(f"{err}\n{logs}") from None
    return joiners


def _victim(job: Job, joiners: list[Job], kind: str) -> psutil.Process:
    """A live worker of ``kind`` (see kill_and_join); the other kind when none of it is left."""
    workers = {rank: proc for rank, proc in job.workers().items() if _alive(proc)}
    if kind == "writer":
        if 0 not in workers:
            raise AssertionError("the launched rank 0 (the first writer) is not alive")
        return workers[0]
    launched = [workers[rank] for rank in sorted(workers) if rank != 0]
    joined = [proc for proc in (worker_of(j) for j in joiners if "joined as rank" in j.stderr) if proc is not None]
    candidates = launched + joined if kind == "launched" else joined + launched
    if not candidates:
        raise AssertionError(f"no live {kind} worker to kill but rank 0")
    return candidates[0]


def _who(job: Job, joiners: list[Job], proc: psutil.Process) -> str:
    launched = {p.pid: rank for rank, p in job.workers().items()}
    if proc.pid in launched:
        return f"the worker launched as rank {launched[proc.pid]}"
    return next((f"joiner {n}'s worker" for n, j in enumerate(joiners) if worker_of(j) == proc), "unknown")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
