"""Start workers through torch's elastic launcher (the engine of torchrun), not a home-made spawner.

``ringtrain train`` calls ``launch``: this process runs torch's elastic agent, which rendezvouses with
the agents of the other nodes (c10d rendezvous) and starts ``python -m ringtrain.worker`` once per local
worker, restarting them up to ``max_restarts`` times when one fails.

Every listening socket binds to loopback (127.0.0.1) unless the user names another address:
- the rendezvous store is hosted here, by node 0's launcher, on a socket bound to the endpoint's address
  (torch's own would listen on every interface), and every agent joins it as a client;
- the workers' store is hosted by worker 0 the same way (``group/init.py``), and Gloo/NCCL are told the
  interface that holds the bind address.

A job that may shrink and grow (``--min-nproc M`` below ``--nproc N``) runs one single-worker agent per
worker instead (``elastic.py``); each of them is a ``launch`` with ``join=True``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ringtrain.group import rendezvous
from ringtrain.group.addresses import RENDEZVOUS_WAIT_S, bind_address
from ringtrain.group.auth import SECRET_FILE_VAR, SECRET_VAR, JobSecret, SecretError, load_job_secret
from ringtrain.group.env import BIND_ADDR_VAR, HEAL_VAR, JOB_STORE_VAR, LAUNCHER_VAR
from ringtrain.group.failure import failure_report
from ringtrain.group.jobstore import JobStore
from ringtrain.group.lifetime import STOP_SIGNALS
from ringtrain.group.watch import host_answers
from ringtrain.errors import LaunchError, RingtrainError

__all__ = ["LaunchOptions", "Program", "WorkerFailed", "JobStopped", "launch", "parse_rdzv_conf", "RDZV_DEFAULTS",
           "stop_signals", "job_secret_for", "default_run_id"]

LOOPBACK = "127.0.0.1"

RDZV_DEFAULTS = {"last_call_timeout": 5, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}
"""ringtrain's rendezvous timing (torch's: 30 s last call, a lost agent noticed after 15 s): after a lost
worker the others re-form within about 10 s. ``--rdzv-conf`` overrides any of these (seconds)."""
_RDZV_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
              "keep_alive_max_attempt", "read_timeout")
"""read_timeout: also how long a node waits for the rendezvous endpoint to answer (group/addresses.py: 45 s)."""
_WORKER_LOG = "torch.distributed.elastic.multiprocessing.api"
"""The agent's logger of worker processes: 'Sending process N closing signal SIGTERM', 'failed (exitcode: 2)'."""
_AGENT_LOG = "torch.distributed.elastic.agent.server.api"
"""The agent's own logger: on Ctrl-C or SIGTERM it warns 'Received 2 death signal, shutting down workers'."""
_SPAWN_LOG = "torch.multiprocessing.spawn"
WORKER_START_VAR = "RINGTRAIN_WORKER_START"
"""``spawn``: every ``ringtrain train`` worker a fresh interpreter (``python -u -m ringtrain.worker``), as
before workers were forked from a warm forkserver (``_entrypoint``)."""
FORKSERVER_PRELOAD = ("ringtrain.preload",)
"""What the forkserver imports once for all of a node's workers (ringtrain/preload.py: torch, torch._dynamo,
the trainer; ~3.3 s of CPU an interpreter here), then freezes for the garbage collector."""


class _ShutdownNoise(logging.Filter):
    """Drops the agent's 'Received N death signal' warning: the stop is ringtrain's to report (the workers'
    "stopped at step N" lines and the launcher's last line, cli.py), once. Every other agent record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in str(record.msg)


class WorkerFailed(RingtrainError):
    """A worker exited with an error or was killed, and no restarts were left."""

    exit_code = 1


class JobStopped(RingtrainError):
    """The launcher itself got SIGINT/SIGTERM; its workers were stopped."""

    def __init__(self, signal_number: int):
        name = signal.Signals(signal_number).name
        super().__init__(f"stopped by {name}; workers that were training saved the step they reached "
                         "(continue later with --resume)")
        self.exit_code = 128 + signal_number


@dataclass(frozen=True)
class Program:
    """What every worker runs: ``python -u ARGS`` in ``cwd`` with ``env`` added to the launcher's environment.
    The same program on every start: the first, a restart, a worker that joins later."""

    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None

    @classmethod
    def worker(cls, worker_args: list[str]) -> Program:
        """``ringtrain train``'s workers: ``python -m ringtrain.worker CONFIG ...``."""
        return cls(("-m", "ringtrain.worker", *worker_args))

    def worker_argv(self) -> list[str] | None:
        """The arguments after ``-m ringtrain.worker`` for ``ringtrain train``'s workers; None for a script."""
        return list(self.args[2:]) if self.args[:2] == ("-m", "ringtrain.worker") else None

    @classmethod
    def script(cls, path: str, script_args: list[str], env: dict[str, str]) -> Program:
        """``ringtrain run``'s workers: the user's script (which calls ringtrain.fit), from this folder."""
        return cls((path, *script_args), tuple(sorted(env.items())), os.getcwd())

    def to_json(self) -> dict:
        return {"args": list(self.args), "env": dict(self.env), "cwd": self.cwd}

    @classmethod
    def from_json(cls, value: dict) -> Program:
        return cls(tuple(value["args"]), tuple(sorted(value.get("env", {}).items())), value.get("cwd"))


@dataclass(frozen=True)
class LaunchOptions:
    """The launch flags; they mirror torchrun's."""

    nproc: int = 1
    """Workers on this node (torchrun's --nproc-per-node)."""
    nnodes: str = "1"
    """Number of nodes, or MIN:MAX for an elastic job."""
    node_rank: int = 0
    """This node's index; node 0 hosts the rendezvous store."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous; unset on a single node: a free port on 127.0.0.1."""
    local_addr: str | None = None
    """Address of this node that workers bind to (default: node 0: the endpoint's host; other nodes: the
    address they reach the endpoint from; a single node: loopback)."""
    max_restarts: int = 0
    """Restarts of the worker group after a failure before the job fails."""
    min_nproc: int | None = None
    """Fewest workers on this node the job may shrink to (one agent per worker); unset: nproc, fixed size."""
    rdzv_conf: str = ""
    """torchrun's --rdzv-conf: KEY=SECONDS,... for the c10d rendezvous (see RDZV_DEFAULTS)."""
    join: bool = False
    """Join a job whose rendezvous store another process hosts (an elastic worker's agent)."""
    run_id: str = ""
    """Rendezvous id shared by all nodes of the job (default: derived from the endpoint)."""
    log_dir: str | None = None
    """Where the agent keeps per-attempt error files (default: a temporary folder)."""
    heal: bool = False
    """--heal: workers heal in place when one is lost (``[dist] heal``); the agents never restart them."""
    sigusr1_stops: bool = False
    """A SLURM job (cluster.py): SIGUSR1, SLURM's warning before the time limit (``--signal=USR1@90``), stops the
    job as SIGTERM does: the workers save the step they reached and the launcher exits 138 (128 + SIGUSR1), which
    the batch script answers with ``scontrol requeue``; the flight recorder's dump request moves to SIGUSR2."""

    def node_range(self) -> tuple[int, int]:
        text = self.nnodes.strip()
        try:
            low, _, high = text.partition(":")
            min_nodes, max_nodes = int(low), int(high or low)
        except ValueError:
            raise LaunchError(f"--nnodes {self.nnodes!r} is not N or MIN:MAX (e.g. 2 or 1:2)") from None
        if not 1 <= min_nodes <= max_nodes:
            raise LaunchError(f"--nnodes {self.nnodes!r}: need 1 <= MIN <= MAX")
        return min_nodes, max_nodes

    @property
    def max_world_size(self) -> int:
        return self.nproc * self.node_range()[1]

    @property
    def per_worker_agents(self) -> bool:
        """An elastic job on this node: one single-worker agent per worker, so each can leave or join."""
        return self.min_nproc is not None and self.min_nproc < self.nproc

    def world_size_range(self) -> tuple[int, int]:
        """Fewest and most workers the job may run with."""
        min_nodes, max_nodes = self.node_range()
        return min_nodes * (self.min_nproc or self.nproc), max_nodes * self.nproc

    def validate(self) -> None:
        """Raise LaunchError for flag combinations that cannot work; call before any port opens."""
        _, max_nodes = self.node_range()
        if self.nproc < 1:
            raise LaunchError(f"--nproc must be at least 1, got {self.nproc}")
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.min_nproc is not None and not 1 <= self.min_nproc <= self.nproc:
            raise LaunchError(
                f"--min-nproc ({self.min_nproc}) must be between 1 and --nproc ({self.nproc}): "
                "the fewest workers cannot exceed the most"
            )
        parse_rdzv_conf(self.rdzv_conf)
        if self.heal and not (self.per_worker_agents or self.join):
            raise LaunchError(
                f"--heal needs one agent per worker: add --min-nproc below --nproc ({self.nproc}), the fewest "
                "workers healing keeps the job at"
            )
        if self.heal and self.max_restarts:
            raise LaunchError(
                f"--heal keeps the surviving workers running instead of restarting them: drop --max-restarts "
                f"{self.max_restarts} (below --min-nproc the workers save the step they reached; --resume continues)"
            )
        if not 0 <= self.node_rank < max_nodes:
            raise LaunchError(f"--node-rank {self.node_rank} must be in [0, {max_nodes}) for --nnodes {self.nnodes}")
        if max_nodes > 1 and not self.rdzv_endpoint:
            raise LaunchError("a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.rdzv_endpoint:
            _, port = split_endpoint(self.rdzv_endpoint)
            if port == 0 and max_nodes > 1:
                raise LaunchError(f"--rdzv-endpoint {self.rdzv_endpoint}: a multi-node job needs a fixed port")


def launch(options: LaunchOptions, program: Program) -> None:
    """Run ``program`` (``python -m ringtrain.worker ...`` or a user's script) under torch's elastic agent on
    this node.

    Raises WorkerFailed naming the first failed rank, or LaunchError when the rendezvous fails.
    """
    options.validate()
    _check_worker_start()
    secret = job_secret_for(options)
    min_nodes, max_nodes = options.node_range()
    if options.heal and options.join:
        # A --heal launcher's own agents (elastic.py): the rendezvous only starts the job, who is in it later is
        # the heal's business (HEAL_VAR keeps --min-nproc), so they start it all together, every worker asked
        # for. A round that closes at the minimum left a loaded host's slowest agent out (at load 15 its joins
        # kept losing the race for the rendezvous state to the others' keep-alives until the last call closed
        # the round), and nothing would ever admit it.
        min_nodes = max_nodes
    host, port = split_endpoint(options.rdzv_endpoint or f"{LOOPBACK}:0")
    hosts_store = options.node_rank == 0 and not options.join
    # A wrong --local-addr or an endpoint nobody answers at: one line now, not torch's 600 s join timeout.
    wait_s = parse_rdzv_conf(options.rdzv_conf).get("read_timeout", RENDEZVOUS_WAIT_S)
    bind_addr = bind_address(options.local_addr, host, port, hosts_store, wait_s)
    store = host_rendezvous_store(host, port) if hosts_store else None
    if store is not None:
        port = store.port
    _export_worker_env(bind_addr, f"{_bracket(host)}:{port}")
    if options.heal:
        _heal_in_place(*options.world_size_range())
    os.environ.update(dict(program.env))
    if program.cwd:
        os.chdir(program.cwd)  # the agent starts its workers where it runs
    _pick_worker_store_ports_outside_the_ephemeral_range()
    rendezvous.register()
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=options.nproc,
        run_id=options.run_id or default_run_id(secret, host, port),
        # torch's c10d rendezvous over a store sealed with the job's secret (group/rendezvous.py).
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{_bracket(host)}:{port}",
        # Node 0's launcher hosts the store above; every agent, node 0's included, joins as a client.
        # node_rank: torch ranks a round's nodes by address; ringtrain's handler by --node-rank first, so global
        # rank 0 runs on node 0 (group/rendezvous.py).
        rdzv_configs={**parse_rdzv_conf(options.rdzv_conf), "is_host": False,
                      rendezvous.NODE_RANK_OPTION: options.node_rank},
        max_restarts=options.max_restarts,
        local_addr=bind_addr,
        logs_specs=DefaultLogsSpecs(log_dir=options.log_dir),
        start_method="forkserver",  # used only by a function entrypoint (_entrypoint)
    )
    entrypoint, entry_args, forks = _entrypoint(options, program)
    dump_signal = signal.SIGUSR2 if options.sigusr1_stops else signal.SIGUSR1
    previous = {dump_signal: signal.signal(dump_signal, _dump_request_handler(host, port, config.run_id, secret,
                                                                               dump_signal))}
    if options.sigusr1_stops:
        # As torch's agent does for SIGTERM: it stops every worker with this same signal (they save), then re-raises.
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, _stop_handler)
    # The agent logs each worker it stops and each failed exit code (E/W lines); the launcher's own line below
    # says which worker failed and why, once.
    worker_log = logging.getLogger(_WORKER_LOG)
    worker_log_level = worker_log.level
    worker_log.setLevel(logging.CRITICAL)
    # Forked workers: torch's process context warns 'Terminating process N via signal SIGTERM' for each worker
    # it stops after one failed, as the agent's own (silenced) logger does for processes it started.
    spawn_log = logging.getLogger(_SPAWN_LOG)
    spawn_log_level = spawn_log.level
    spawn_log.setLevel(logging.CRITICAL)
    shutdown_noise = _ShutdownNoise()
    logging.getLogger(_AGENT_LOG).addFilter(shutdown_noise)
    try:
        elastic_launch(config, entrypoint)(*entry_args)
    except ChildFailedError as err:
        raise _describe_failure(err) from None
    except SignalException as err:
        raise JobStopped(err.sigval) from None
    except RendezvousConnectionError:
        if hosts_store:
            raise LaunchError(f"rendezvous at {host}:{port} failed: this launcher's own store stopped answering") from None
        raise LaunchError(_rendezvous_host_lost(host, port)) from None
    except RendezvousError as err:
        raise LaunchError(f"rendezvous at {host}:{port} failed: {str(err) or type(err).__name__}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        worker_log.setLevel(worker_log_level)
        spawn_log.setLevel(spawn_log_level)
        logging.getLogger(_AGENT_LOG).removeFilter(shutdown_noise)
        if forks:
            _stop_forkserver()
        rendezvous.stop_heartbeats()  # torch leaves them running after a signal (group/rendezvous.py)
        # The rendezvous store lives exactly as long as this node's agent.
        del store


def _entrypoint(options: LaunchOptions, program: Program) -> tuple[object, tuple, bool]:
    """What torch's agent starts for each worker: (entrypoint, its arguments, whether workers fork).

    ``ringtrain train``'s workers, two or more on this node, fork from one forkserver that imports torch,
    torch._dynamo and the trainer once (``FORKSERVER_PRELOAD``), instead of each worker importing them in an
    interpreter of its own (~3.3 s of CPU each here, most of a small job's start). The forkserver starts here,
    after the environment and folder above are set, from this process's environment; it stops with this
    launch. One worker per agent (``--min-nproc``, ``--heal``, ``ringtrain join``) saves
    nothing that way, and a user's script runs as Python runs it: ``python -u SCRIPT`` in an interpreter of its
    own, as does every worker under ``RINGTRAIN_WORKER_START=spawn``."""
    argv = program.worker_argv()
    if argv is None or options.nproc < 2 or os.environ.get(WORKER_START_VAR) == "spawn":
        return sys.executable, ("-u", *program.args), False
    import multiprocessing
    from multiprocessing import forkserver

    # Unbuffered as `python -u`: the workers' lines reach the launcher's streams as they are written.
    os.environ["PYTHONUNBUFFERED"] = "1"
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    # Started now, so that its imports overlap the rendezvous, and with STOP_SIGNALS blocked (as multiprocessing's
    # resource tracker, which it starts, has them): SLURM's SIGUSR1 to every process of the step must leave
    # the workers' parent alive while they save.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return _forked_worker, (argv,), True


def _check_worker_start() -> None:
    """RINGTRAIN_WORKER_START, when set, says spawn or forkserver: a typo must not pass for the default."""
    value = os.environ.get(WORKER_START_VAR)
    if value is not None and value not in ("spawn", "forkserver"):
        raise LaunchError(f"{WORKER_START_VAR}={value!r}: set it to 'spawn' (every worker an interpreter of its own) "
                          "or 'forkserver' (the default: workers fork from one warm process), or unset it")


def _forked_worker(argv: list[str]) -> None:
    """A forked worker's entry (pickled by name to the forkserver's child): ``ringtrain.worker.forked``."""
    from ringtrain import worker

    worker.forked(argv)


def _stop_forkserver() -> None:
    """The next launch in this process starts a forkserver of its own, from the environment it sets."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _rendezvous_host_lost(host: str, port: int) -> str:
    """The store that node 0's launcher hosts dropped this agent's connection, or stopped answering."""
    if host_answers(host):
        return (f"the rendezvous host {host} is gone: its store at {host}:{port} dropped the connection and the host "
                "answers on the network (node 0's launcher died); start the job again with --resume")
    return (f"the rendezvous host {host} is unreachable: its store at {host}:{port} does not answer (its link or the "
            "host is down, or this host lost its link); start the job again with --resume")


def stop_signals(options: LaunchOptions) -> tuple[int, ...]:
    """The signals that stop a job (its workers save the step they reached): SIGUSR1 too in a SLURM job."""
    return (signal.SIGINT, signal.SIGTERM, *((signal.SIGUSR1,) if options.sigusr1_stops else ()))


def _stop_handler(signum, frame) -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _dump_request_handler(host: str, port: int, run_id: str, secret: JobSecret, signum: int = signal.SIGUSR1):
    """SIGUSR1 (SIGUSR2 in a SLURM job) to a launcher: ask every worker of the job (all nodes) to write its flight
    recorder to RUN_DIR/flight/rank-R.json. Each worker's heartbeat thread answers, even one stuck in a collective."""
    name = signal.Signals(signum).name

    def request() -> None:
        try:
            JobStore(host, port, f"ringtrain/{run_id}/", is_writer=False, secret=secret).request_dump()
            print(f"ringtrain: {name}: asked every worker to write its flight recorder to RUN_DIR/flight/rank-R.json; "
                  "then run `ringtrain diagnose RUN_DIR`", file=sys.stderr, flush=True)
        except (RuntimeError, ValueError) as err:
            print(f"ringtrain: {name}: could not reach the job store at {host}:{port} ({err})", file=sys.stderr, flush=True)

    def handle(signum, frame) -> None:
        # Not in the handler itself: the main thread may be inside the agent's own store calls.
        threading.Thread(target=request, name="ringtrain-dump-request", daemon=True).start()

    return handle


def job_secret_for(options: LaunchOptions) -> JobSecret:
    """The job's secret (group/auth.py), in this process's environment from now on, so that every agent and
    worker it starts inherits it: the one the user gave (RINGTRAIN_JOB_SECRET or RINGTRAIN_JOB_SECRET_FILE),
    else a new one. A job of several nodes must share one (each node's launcher is started on its own), and an
    agent that joins a running job must have the job's."""
    try:
        secret = load_job_secret(os.environ)
    except SecretError as err:
        raise LaunchError(str(err)) from None
    if secret is None:
        if options.join:
            raise LaunchError(f"joining a job needs its secret: set {SECRET_VAR} (or {SECRET_FILE_VAR}) as the job's "
                              "launcher had it, or join from the account that started it")
        if options.node_range()[1] > 1:
            raise LaunchError(
                f"a job of several nodes needs one secret on every node: export {SECRET_VAR}=... (the same value on "
                f"each, e.g. from `openssl rand -hex 32`) or {SECRET_FILE_VAR}=FILE (mode 0600) before launching; "
                "--hostfile hands its hosts one itself")
        secret = JobSecret.new()
    os.environ[SECRET_VAR] = secret.hex
    return secret


def default_run_id(secret: JobSecret, host: str, port: int) -> str:
    """The rendezvous id: the same on every node of the job (they share the secret and the endpoint), and no one
    without the secret can name the job's store keys."""
    return f"ringtrain-{secret.derive('run-id', f'{host}:{port}')[:24]}"


def parse_rdzv_conf(text: str) -> dict[str, int]:
    """'last_call_timeout=1,keep_alive_interval=1' -> ringtrain's defaults updated with those."""
    conf = dict(RDZV_DEFAULTS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if key not in _RDZV_KEYS:
            raise LaunchError(f"--rdzv-conf: unknown key {key!r}; known: {', '.join(_RDZV_KEYS)}")
        if not sep or not value.isdigit() or int(value) < 1:
            raise LaunchError(f"--rdzv-conf {item!r}: give {key} as a whole number of at least 1, e.g. {key}=5")
        conf[key] = int(value)
    if conf["keep_alive_max_attempt"] < 3:
        # torch's agent may beat only every second interval; with fewer attempts a live agent expires.
        raise LaunchError(
            f"--rdzv-conf keep_alive_max_attempt={conf['keep_alive_max_attempt']} would drop live agents "
            "(they may beat only every other interval); use 3 or more"
        )
    return conf


def _pick_worker_store_ports_outside_the_ephemeral_range() -> None:
    """The agent on node 0 picks the port of the worker group's store (rank 0 listens on it), and the worker binds
    it seconds later, once it has imported torch. torch picks it by binding port 0 and closing the socket
    (``get_free_port``: "not reserved and may be taken by another process"), so from the kernel's ephemeral range,
    where every outgoing connection on the machine also gets its local port: under load one did, between the pick
    and the bind ("cannot listen on 127.0.0.1:41365 (Address already in use)", a full test run beside other
    jobs). Picked here below that range, where only listeners bind, and checked free."""
    import torch.distributed.elastic.rendezvous.api as rendezvous_api

    rendezvous_api.get_free_port = _listener_port


def _listener_port() -> int:
    """A port free now, below the ephemeral range (``ip_local_port_range``); torch's choice where there is no
    room below it."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = max(1024, ephemeral_low - 12288)
    for port in random.sample(range(low, ephemeral_low), min(64, max(0, ephemeral_low - low))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    from torch.distributed.elastic.utils.distributed import get_free_port

    return get_free_port()


def _export_worker_env(bind_addr: str | None, job_store: str) -> None:
    # The agent passes this process's environment on to every worker it starts.
    os.environ[LAUNCHER_VAR] = "1"
    # The rendezvous store outlives every worker: they keep progress and heartbeats there (group/jobstore.py).
    os.environ[JOB_STORE_VAR] = job_store
    if bind_addr:
        os.environ[BIND_ADDR_VAR] = bind_addr
    # Workers host their own loopback-bound store (group/init.py) instead of sharing the agent's,
    # which torch would open on every interface.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # A worker that dies of a signal (SIGSEGV, SIGABRT: a native library's crash) prints every thread's Python
    # stack first, so the crash names where it happened; a user's own setting is kept.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def _heal_in_place(min_workers: int, max_workers: int) -> None:
    """--heal, in this (single-worker) agent: its worker heals in place and the agent never restarts it
    (max_restarts 0, checked by validate). Torch's agent also waits, after its worker succeeded, in an exit
    barrier for every agent of the rendezvous round, 300 s for one whose worker was healed away; the
    launcher (elastic.py) already waits for every agent, so this agent skips that barrier."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    os.environ[HEAL_VAR] = f"{min_workers}:{max_workers}"
    SimpleElasticAgent._exit_barrier = lambda self: None
    # The rendezvous only starts the job: who is in it from then on is the heal's business (the job store). An
    # agent whose rendezvous keep-alive lapsed on a loaded machine would otherwise come back as a "new node" and
    # every agent would restart its worker (membership changes do not count as restarts in torch's agent).
    DynamicRendezvousHandler.num_nodes_waiting = lambda self: 0


def host_rendezvous_store(host: str, port: int) -> dist.TCPStore:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as err:
        raise LaunchError(
            f"cannot listen on {host}:{port} for the rendezvous ({err.strerror}); "
            "choose another --rdzv-endpoint port, or stop the job that holds it"
        ) from None
    bound_port = listener.getsockname()[1]
    return dist.TCPStore(
        host,
        bound_port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
        master_listen_fd=listener.detach(),
    )


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port_text = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 127.0.0.1:29500)")
    return host, int(port_text)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _describe_failure(err: ChildFailedError) -> RingtrainError:
    """One line naming why the job failed. A worker killed from outside (not by the agent's SIGTERM) is the
    cause; otherwise the earliest worker whose own error started it (its error file says so: group/failure.py),
    named with its exception and where its traceback is; otherwise the earliest report. When the cause is a
    usage error (a config or part that does not fit) and no worker failed in any other way, the line is the
    worker's own message and the exit code 2, as for a mistake the launcher finds itself."""
    failures = err.failures
    killed = [(rank, f) for rank, f in failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"]
    reports = {rank: failure_report(f.message) for rank, f in failures.items()}
    if killed:
        rank, failure = killed[0]
    else:
        rank = _first_reported(reports, ("usage", "cause"))
        rank = _first_reported(reports, ("consequence",)) if rank is None else rank
        rank, failure = (rank, failures[rank]) if rank is not None else err.get_first_failure()
    report = reports.get(rank) if not killed else None
    if report is not None and report["kind"] == "usage" and all(
            (r is not None and r["kind"] != "cause") or (failures[k].exitcode < 0 and failures[k].signal_name() == "SIGTERM")
            for k, r in reports.items()):
        return LaunchError(report["line"])
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    if report is not None:
        detail = report["line"].split("] ", 1)[-1]
        if report.get("traceback"):
            detail += f" (traceback: {report['traceback']})"
    else:
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        lines = (message or "").strip().splitlines()
        detail = lines[0] if lines and not lines[0].startswith(("To enable traceback", "Signal ")) else ""
    others = len(failures) - 1
    text = f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
    if detail:
        text += f": {detail}"
    if others:
        text += f" ({others} other worker{'s' * (others > 1)} stopped too)"
    return WorkerFailed(text)


def _first_reported(reports: dict[int, dict | None], kinds: tuple[str, ...]) -> int | None:
    """The rank whose report of one of ``kinds`` is the earliest, or None."""
    found = [(r["time"], rank) for rank, r in reports.items() if r is not None and r["kind"] in kinds]
    return min(found)[1] if found else None
