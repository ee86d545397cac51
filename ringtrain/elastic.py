"""Elastic jobs: one single-worker elastic agent per worker, joined by one c10d rendezvous.

``ringtrain train CONFIG --nproc N --min-nproc M --max-restarts K`` is torchrun's ``--nnodes M:N`` on one
host, the way PyTorch's own double-agent fault-tolerance tests run it: this process hosts the rendezvous
store (on loopback) and starts N agents, ``python -m ringtrain join``, each one a torch elastic agent with
one worker. Torch's agents then do the work:

- a worker dies: its agent restarts it; every agent re-forms the group at the same size, and the workers
  continue from the last checkpoint (one of K restarts);
- an agent is lost (killed, its host gone) and cannot restart its worker: the others re-form without it,
  down to M workers, once its rendezvous heartbeat expires;
- an agent joins (``ringtrain join RUN_DIR``, or the same ``ringtrain train`` flags on another host): the
  running workers checkpoint and stop at the next step, and the group re-forms one larger.

The store lives in this process, so killing any agent or worker leaves it up. The job's description is
written to ``RUN_DIR/job.json`` for ``ringtrain join``.

Elastic *nodes* (``--nnodes MIN:MAX``, one launcher per host, each one agent for its ``--nproc`` workers) write
the same file from node 0 (``write_job_file``): a host that lost the job (its link went down, the others went
on without it) comes back with ``ringtrain join RUN_DIR --local-addr ITS_ADDRESS``, an agent for ``--nproc``
workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ringtrain.comm.groups import host_id
from ringtrain.group.auth import (SECRET_VAR, JobSecret, SecretError, forget_job_secret, load_job_secret,
                                  save_job_secret, saved_job_secret)
from ringtrain.group.env import BIND_ADDR_VAR, HEAL_JOIN_VAR, HEAL_VAR, JOB_STORE_VAR, LAUNCHER_VAR, forget_fault_plan
from ringtrain.group.jobstore import JobStore
from ringtrain.errors import LaunchError
from ringtrain.heal.liveness import ExitReporter, exit_key, finished_key
from ringtrain.heal.membership import job_keys
from ringtrain.launch import (
    JobStopped,
    LaunchOptions,
    Program,
    WorkerFailed,
    default_run_id,
    host_rendezvous_store,
    job_secret_for,
    launch,
    split_endpoint,
    stop_signals,
)

__all__ = ["JobSpec", "launch_worker_agents", "join_job", "join_healing_job", "write_job_file", "JOB_FILE"]

JOB_FILE = "job.json"

START_BARRIER_VAR = "RINGTRAIN_START_BARRIER"
"""Set by the launcher for its own agents only, 'DIR:N': each agent marks DIR when it is about to rendezvous and
waits there for all N (or for DIR/go: an agent exited first). The c10d rendezvous closes ``last_call_timeout``
(5 s) after the minimum of agents arrived; on a loaded host one agent's start (importing torch) can lag the
others' by more than that, and the job would begin without a worker the user asked for (seen: 2 of 3 beside
busy processes, the third agent's rendezvous then failed)."""
START_BARRIER_S = 300.0
"""The most a launched agent waits for its siblings before it rendezvouses anyway (one that hangs while starting)."""


@dataclass(frozen=True)
class JobSpec:
    """What an agent needs to join the job: the rendezvous and what its worker runs."""

    rdzv_endpoint: str
    run_id: str
    min_workers: int
    max_workers: int
    max_restarts: int
    rdzv_conf: str
    program: Program
    """What each worker runs (``ringtrain.worker`` or the user's script, its arguments, folder, environment)."""
    log_dir: str
    nproc: int = 1
    """Workers per agent: 1 for --min-nproc jobs (one agent per worker), --nproc for elastic nodes."""
    heal: bool = False
    """--heal: workers heal in place when one is lost; the agents never restart them."""

    def to_json(self, secret: JobSecret | None = None) -> str:
        """The description as JSON; with the job's secret, sealed (``seal``: its HMAC), as job.json is."""
        values = {**asdict(self), "program": self.program.to_json()}
        if secret is not None:
            values["seal"] = secret.tag(JOB_FILE, _canonical(values)).hex()
        return json.dumps(values)

    @classmethod
    def from_json(cls, text: str, secret: JobSecret | None = None, where: str = "the job description") -> JobSpec:
        """JSON only (a planted file unpickles nothing), every field of its type, else ValueError naming it. With
        ``secret``, its seal must match (UnsealedJobFile otherwise): ``ringtrain join`` starts the program a job file
        names, so it runs only what the job's own launcher wrote (docs/security.md: the threat model)."""
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"a JSON {type(values).__name__}, not an object")
        seal = values.pop("seal", None)
        if secret is not None:
            import hmac

            expected = secret.tag(JOB_FILE, _canonical(values)).hex()
            if not isinstance(seal, str) or not hmac.compare_digest(seal, expected):
                raise UnsealedJobFile(
                    f"{where} is not sealed with the job's secret ({'no seal' if seal is None else 'a wrong seal'}): "
                    "it was not written by the job's launcher; refused, nothing it names was started")
        for name, kind in _FIELD_TYPES.items():
            if name in values and type(values[name]) is not kind:
                raise ValueError(f"{name} is {values[name]!r}, not a {kind.__name__}")
        program = values.get("program")
        if not (isinstance(program, dict) and isinstance(program.get("args"), list)
                and all(isinstance(a, str) for a in program["args"])
                and isinstance(program.get("env", {}), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in program.get("env", {}).items())
                and isinstance(program.get("cwd"), (str, type(None)))):
            raise ValueError("program is not {args: [strings], env: {string: string}, cwd: string or null}")
        return cls(**{**values, "program": Program.from_json(program)})

    @classmethod
    def read(cls, run_dir: str | Path) -> JobSpec:
        """RUN_DIR/job.json, opened with the job's secret: the environment's (RINGTRAIN_JOB_SECRET[_FILE]), else
        the one this account's launcher kept for the run id the file names (group/auth.save_job_secret)."""
        path = Path(run_dir) / JOB_FILE
        try:
            text = path.read_text()
            run_id = json.loads(text).get("run_id") if text.lstrip().startswith("{") else None
            secret = load_job_secret(os.environ) or (
                saved_job_secret(run_id) if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id) else None)
            if secret is None:
                raise LaunchError(
                    f"{path}: no secret for this job here: join from the account that started it (its launcher "
                    f"keeps the secret while the job runs), or set {SECRET_VAR} as the job's launcher had it")
            spec = cls.from_json(text, secret, str(path))
        except FileNotFoundError:
            raise LaunchError(
                f"{path} not found: join works for a running job started with --min-nproc below --nproc"
            ) from None
        except (SecretError, UnsealedJobFile) as err:
            raise LaunchError(str(err)) from None
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as err:
            raise LaunchError(f"{path} is not a ringtrain job description ({err})") from None
        os.environ[SECRET_VAR] = secret.hex  # the agent and its workers join with it
        return spec


class UnsealedJobFile(ValueError):
    """A job file whose seal does not match the job's secret."""


def _canonical(values: dict) -> bytes:
    return json.dumps(values, sort_keys=True, separators=(",", ":")).encode()


_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""A run id names a file of the account's secrets: a plain name, never a path."""


_FIELD_TYPES = {"rdzv_endpoint": str, "run_id": str, "min_workers": int, "max_workers": int, "max_restarts": int,
                "rdzv_conf": str, "log_dir": str, "nproc": int, "heal": bool}


def launch_worker_agents(options: LaunchOptions, program: Program, run_dir: str, log_dir: str) -> None:
    """Host the rendezvous (node 0), start one agent per local worker, wait for them all.

    Returns when the job finished (an agent's workers completed it); raises WorkerFailed when every agent
    failed, JobStopped when this process was told to stop.
    """
    options.validate()
    secret = job_secret_for(options)  # in the environment: every agent and worker started here inherits it
    min_workers, max_workers = options.world_size_range()
    host, port = split_endpoint(options.rdzv_endpoint or "127.0.0.1:0")
    store = host_rendezvous_store(host, port) if options.node_rank == 0 else None
    port = store.port if store is not None else port
    spec = _spec(options, program, log_dir, host, port, min_workers, max_workers, secret, nproc=1)
    if options.node_rank == 0:
        _write(spec, run_dir, secret)
    # Node 0's workers bind where its rendezvous listens; other nodes' to --local-addr (or torch's choice).
    local_addr = options.local_addr or (host if options.node_rank == 0 else None)
    watch = _HealWatch(host, port, spec.run_id, secret) if options.heal else None
    barrier = Path(tempfile.mkdtemp(prefix="ringtrain-start-"))
    try:
        with watch or nullcontext():
            agents = [_Agent(spec, local_addr, index, f"{barrier}:{options.nproc}") for index in range(options.nproc)]
            _wait(agents, min_workers, watch, stop_signals(options), release=lambda: (barrier / "go").touch())
    finally:
        shutil.rmtree(barrier, ignore_errors=True)
        forget_job_secret(spec.run_id)
        del store  # the rendezvous lives exactly as long as this launcher


def write_job_file(options: LaunchOptions, program: Program, run_dir: str, log_dir: str) -> str:
    """Node 0 of an elastic-nodes job (``--nnodes MIN:MAX``, one agent per host): RUN_DIR/job.json, so that
    ``ringtrain join RUN_DIR`` on a host can (re)join it with an agent for ``options.nproc`` workers. Returns the
    run id (the caller forgets the kept secret when the job ends: group/auth.forget_job_secret)."""
    secret = job_secret_for(options)
    min_workers, max_workers = options.world_size_range()
    host, port = split_endpoint(options.rdzv_endpoint)  # multi-node: a fixed port (validate)
    spec = _spec(options, program, log_dir, host, port, min_workers, max_workers, secret, nproc=options.nproc)
    _write(spec, run_dir, secret)
    return spec.run_id


def _spec(options: LaunchOptions, program: Program, log_dir: str, host: str, port: int, min_workers: int,
          max_workers: int, secret: JobSecret, nproc: int) -> JobSpec:
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return JobSpec(endpoint, options.run_id or default_run_id(secret, host, port), min_workers, max_workers,
                   options.max_restarts, options.rdzv_conf, program, log_dir, nproc, options.heal)


def _write(spec: JobSpec, run_dir: str, secret: JobSecret) -> None:
    """job.json, sealed with the job's secret, which this account keeps for ``ringtrain join`` while the job runs."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    save_job_secret(secret, spec.run_id)
    (Path(run_dir) / JOB_FILE).write_text(spec.to_json(secret) + "\n")


def join_healing_job(spec: JobSpec, local_addr: str | None = None) -> None:
    """``ringtrain join RUN_DIR`` of a --heal job: start one worker here, without an agent or a rendezvous;
    the running workers admit it at a step boundary (train/heal.py). Returns when training ends."""
    _check_running(spec)
    host, _ = split_endpoint(spec.rdzv_endpoint)
    env = {**os.environ, **dict(spec.program.env), JOB_STORE_VAR: spec.rdzv_endpoint, HEAL_JOIN_VAR: "1",
           HEAL_VAR: f"{spec.min_workers}:{spec.max_workers}", LAUNCHER_VAR: "1", "TORCHELASTIC_RUN_ID": spec.run_id,
           BIND_ADDR_VAR: local_addr or host}
    forget_fault_plan(env)  # a joiner is never armed by a test's fault plan (ringtrain/testing/faults.py)
    host_, port = split_endpoint(spec.rdzv_endpoint)
    reports = job_keys(JobStore(host_, port, f"ringtrain/{spec.run_id}/", is_writer=False,
                                secret=load_job_secret(env)))
    # This process is the worker's parent: it records the worker's exit for members on other hosts.
    with ExitReporter(lambda h, pid: reports.set(exit_key(h, pid), "1")):
        worker = subprocess.Popen([sys.executable, "-u", *spec.program.args], env=env, cwd=spec.program.cwd)
        try:
            code = worker.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the worker too: it withdraws its request and exits
            try:
                code = worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                code = worker.wait()
            raise
    if code:
        raise WorkerFailed(f"the joining worker exited with code {code}")


def join_job(spec: JobSpec, local_addr: str | None = None, launched_agent: bool = False) -> None:
    """Run one agent (for ``spec.nproc`` workers) that joins the job's rendezvous (``ringtrain join``).
    ``launched_agent``: one of the launcher's own agents (``join --spec``), whose workers are the launched job's
    and keep a test's fault plan; any other joiner's workers never get it."""
    barrier = os.environ.pop(START_BARRIER_VAR, None)  # the agent passes its environment on to its workers
    if not launched_agent:
        forget_fault_plan()
    _check_running(spec)
    if launched_agent and barrier:
        _rendezvous_together(barrier)
    options = LaunchOptions(
        nproc=spec.nproc,
        nnodes=f"{spec.min_workers // spec.nproc}:{spec.max_workers // spec.nproc}",
        rdzv_endpoint=spec.rdzv_endpoint,
        local_addr=local_addr,
        max_restarts=spec.max_restarts,
        run_id=spec.run_id,
        rdzv_conf=spec.rdzv_conf,
        join=True,
        log_dir=spec.log_dir,
        heal=spec.heal,
    )
    launch(options, spec.program)


def _rendezvous_together(barrier: str) -> None:
    """This launched agent's first rendezvous waits for its siblings (START_BARRIER_VAR) at the last moment: in
    torch's ``next_rendezvous`` itself, after every import and set-up, which take seconds of CPU on a loaded host
    (a barrier before them left the agents that far apart)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    first_round = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        DynamicRendezvousHandler.next_rendezvous = first_round  # later rounds as torch has them
        _start_together(barrier)
        return first_round(self)

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous


def _start_together(barrier: str) -> None:
    """A launched agent about to rendezvous: wait for the launcher's other agents (see START_BARRIER_VAR)."""
    directory, _, count = barrier.rpartition(":")
    path = Path(directory)
    try:
        (path / f"ready-{os.getpid()}").touch()
    except OSError:
        return  # the launcher is gone (and with it the barrier): the rendezvous says what is left
    deadline = time.monotonic() + START_BARRIER_S
    while time.monotonic() < deadline and path.is_dir():
        if (path / "go").exists() or len(list(path.glob("ready-*"))) >= int(count):
            return
        time.sleep(0.02)


class _Agent:
    """One ``ringtrain join`` child; its stderr is relayed line by line and its last error kept."""

    def __init__(self, spec: JobSpec, local_addr: str | None, index: int, start_barrier: str):
        command = [sys.executable, "-m", "ringtrain", "join", "--spec", spec.to_json()]
        if local_addr:
            command += ["--local-addr", local_addr]
        self.index = index
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1,
                                        env={**os.environ, START_BARRIER_VAR: start_barrier})
        self.last_error = ""
        self._relay = threading.Thread(target=self._forward, daemon=True)
        self._relay.start()

    def _forward(self) -> None:
        for line in self.process.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("ringtrain: error: worker rank"):
                self.last_error = line.removeprefix("ringtrain: error: ").strip()

    def finish(self) -> int:
        code = self.process.wait()
        self._relay.join(timeout=5)
        return code

    def describe_exit(self, code: int) -> str:
        if self.last_error:
            return self.last_error
        if code < 0:
            return f"worker agent {self.index} (pid {self.process.pid}) was killed by {signal.Signals(-code).name}"
        return f"worker agent {self.index} (pid {self.process.pid}) exited with code {code}"


class _HealWatch:
    """A --heal launcher's part in healing: it records the exit of every worker it started, so members on other
    hosts know for certain that one is dead (heal/liveness.py), and it learns when the job is done, so a
    worker that was cut off and stays stopped cannot keep the launcher waiting for ever."""

    def __init__(self, host: str, port: int, run_id: str, secret: JobSecret):
        # Clients of their own: the exit reporter writes from its thread, the launcher reads from this one.
        self._reports = job_keys(JobStore(host, port, f"ringtrain/{run_id}/", is_writer=False, secret=secret))
        self._reads = job_keys(JobStore(host, port, f"ringtrain/{run_id}/", is_writer=False, secret=secret))
        self._reporter = ExitReporter(lambda h, pid: self._reports.set(exit_key(h, pid), "1"))

    def __enter__(self) -> _HealWatch:
        self._reporter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._reporter.__exit__(*exc)

    def job_started(self) -> bool:
        """The workers formed the job's first generation (heal/membership.py publishes it)."""
        try:
            return self._reads.check(["current"])
        except RuntimeError:
            return False

    def holds_unfinished_worker(self, agent_pid: int) -> bool:
        """Whether this agent's worker is alive and has not run the job to its end (heal/membership.py
        mark_finished): then it was cut off. On a loaded host a worker that finished can take seconds to exit."""
        try:
            workers = [p for p in psutil.Process(agent_pid).children() if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.Error:
            return False
        me = host_id()
        try:
            return any(not self._reads.check([finished_key(me, worker.pid)]) for worker in workers)
        except RuntimeError:
            return True

    def job_done(self) -> bool:
        try:
            return self._reads.check(["done"])
        except RuntimeError:
            return False

    def job_done_or_unknown(self) -> bool:
        """Whether the job ran to its end, True when the store can no longer say (node 0's launcher, which hosts
        it, already ended): then the agents' exit codes decide, as without --heal."""
        try:
            return self._reads.check(["done"])
        except RuntimeError:
            return True


CUT_OFF_GRACE_S = 15.0
"""Once a --heal job is done, how long the launcher waits for its remaining agents before it stops them: an agent
still running then holds a worker that was cut off from the job (stopped, or hung) and will never finish."""


def _wait(agents: list[_Agent], min_workers: int, watch: _HealWatch | None = None,
          signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM), release: Callable[[], object] = lambda: None) -> None:
    """Wait for every agent; forward ``signals`` (SIGINT, SIGTERM; SIGUSR1 in a SLURM job) to them as SIGTERM;
    decide the job's outcome. ``release``: called when an agent exits (its siblings stop waiting for it at the
    start barrier)."""
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for agent in agents:
            if agent.process.poll() is None:
                agent.process.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        outcomes, done = _collect(agents, min_workers, watch, release)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise JobStopped(received[0])
    # Under --heal a worker also exits 0 when it leaves a broken replica (Spared): the job succeeded only if it
    # ran to its end.
    if any(code == 0 for code, _ in outcomes) and done:
        return
    failed = [description for code, description in outcomes if code != 0]
    if not failed:
        raise WorkerFailed("every worker left the job before its end (their replicas broken, no whole one left)")
    others = len(failed) - 1
    raise WorkerFailed(failed[0] + (f" (and {others} other agent{'s' * (others > 1)} failed)" if others else ""))


def _collect(agents: list[_Agent], min_workers: int, watch: _HealWatch | None = None,
             release: Callable[[], object] = lambda: None) -> tuple[list[tuple[int, str]], bool]:
    """(exit code, description) of each agent, in the order they exited, and whether the job ran to its end
    (always, without --heal: the exit codes say it). Under --heal, once the job is done the agents still running
    get CUT_OFF_GRACE_S, then those whose worker is alive and never finished the job are stopped (their workers
    were cut off); one whose worker finished, or has exited, is only slow to exit."""
    outcomes: list[tuple[int, str]] = []
    done = watch is None
    running = list(agents)
    cut_off: list[_Agent] = []
    done_at: float | None = None
    while running:
        if watch is not None and done_at is None and watch.job_done():
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() - done_at > CUT_OFF_GRACE_S:
            for agent in running:
                if agent not in cut_off and watch.holds_unfinished_worker(agent.process.pid):
                    print(f"ringtrain: the job is done; worker agent {agent.index} (pid {agent.process.pid}) still "
                          f"runs {CUT_OFF_GRACE_S:g} s later: its worker was cut off from the job; stopping it",
                          file=sys.stderr, flush=True)
                    agent.process.kill()  # its worker dies with it (PR_SET_PDEATHSIG), stopped or not
                    cut_off.append(agent)
        for agent in list(running):
            if agent.process.poll() is None:
                continue
            running.remove(agent)
            if agent in cut_off:
                agent.finish()
                continue
            release()
            code = agent.finish()
            outcomes.append((code, agent.describe_exit(code)))
            if code == 0 and not done:  # asked as it exits: the store may end with the last agent's node
                done = watch.job_done_or_unknown()
            if code != 0 and running and watch is not None and not watch.job_started():
                # Its siblings wait in the rendezvous for every worker (join_job): the job cannot start.
                print(f"ringtrain: error: {outcomes[-1][1]} before the job's first step; stopping the other workers",
                      file=sys.stderr, flush=True)
                for other in running:
                    other.process.send_signal(signal.SIGTERM)
            if code < 0 and running:  # an agent lost from outside; a failure of its own ends the job anyway
                print(f"ringtrain: {outcomes[-1][1]}; the job continues without it while {min_workers} or more "
                      "workers remain", file=sys.stderr, flush=True)
        time.sleep(0.1)
    return outcomes, done


def _check_running(spec: JobSpec) -> None:
    host, port = split_endpoint(spec.rdzv_endpoint)
    try:
        # A plain connection: torch's TCPStore client would retry for its whole timeout and log each try.
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        raise LaunchError(
            f"no job is running at {spec.rdzv_endpoint} (run id {spec.run_id}); start it again with "
            "ringtrain train ... --resume"
        ) from None
