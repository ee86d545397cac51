"""The ``ringtrain`` command: argv in, a launched job or a report out; no training logic here.

    ringtrain train configs/digits_mlp.toml --nproc 2 [--run-dir runs/x] [--set train.lr=0.1] [--resume]
    ringtrain report RUN_DIR [--compare OTHER_RUN_DIR]         # plots + where the time went
    ringtrain config [configs/digits_mlp.toml] [--set ...]   # the resolved config, or every field documented
    ringtrain join RUN_DIR            # add a worker to a running elastic job (--min-nproc below --nproc)
    ringtrain ledger RUN_DIR          # prove every epoch used each sample exactly once ([data] ledger = true)
    ringtrain export RUN_DIR          # the newest valid checkpoint's weights as model.safetensors
    ringtrain bench collectives --nproc 2,4 --sizes 4K:64M --out bench-out   # all_reduce bandwidth sweep
    ringtrain bench train CONFIG --nproc 1,2 --strategies ddp,ddp:shm --out DIR # throughput, scaling, overhead
    ringtrain plan calibrate | validate BENCH_JSON --params N | table              # the cost model
    ringtrain diagnose RUN_DIR        # line up every rank's flight recorder: who is behind, who disagrees
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

# Before torch loads (below): c10d's C++ warnings off unless the user asks for them. A job that stops (Ctrl-C,
# SIGTERM from SLURM) closes its stores, and a peer's agent or worker still reading one logged its warning with
# a ~25-line C++ stack (`TCPStore recvVector failed ... Exception raised from recvBytes`); errors still show.
# The workers inherit it; a user's own TORCH_CPP_LOG_LEVEL (INFO, WARNING) is kept.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from ringtrain.bench.cli import add_bench_parser
from ringtrain.bench.plan import add_plan_parser
from ringtrain.errors import RingtrainError
from ringtrain.hostfile import add_hostfile_arguments

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringtrain", description="Distributed data-parallel training for PyTorch, and why it is fast or slow."
    )
    from ringtrain import __version__

    parser.add_argument("--version", action="version", version=f"ringtrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(commands)
    _add_run(commands)
    add_bench_parser(commands)
    add_plan_parser(commands)
    _add_report(commands)
    _add_config(commands)
    _add_fault_tolerance_tools(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `ringtrain run SCRIPT [flags] -- SCRIPT_ARGS`: what follows `--` is the script's, never ringtrain's.
    script_args: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:
        split = argv.index("--")
        argv, script_args = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    args.script_args = script_args
    try:
        return args.handler(args) or 0
    except RingtrainError as err:
        print(f"ringtrain: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("ringtrain: interrupted", file=sys.stderr)
        return 130


def _add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    parser.add_argument("config", nargs=None if config_required else "?", help="TOML config file, e.g. configs/digits_mlp.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field, e.g. --set train.lr=0.05 (repeatable)")


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="train a model on N workers", description="Train a model on N workers.")
    _add_config_arguments(train)
    _add_run_arguments(train, "runs/<config name>")
    _add_launch_arguments(train)
    train.set_defaults(handler=_train)


def _add_run(commands) -> None:
    run = commands.add_parser(
        "run", help="run your script (which calls ringtrain.fit) on N workers",
        description="Start SCRIPT on N workers through torch's elastic launcher, as `ringtrain train` does; its "
                    "ringtrain.fit() trains. --set and --run-dir override the config the script passes to fit().",
    )
    run.add_argument("script", help="a Python script that calls ringtrain.fit(...)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override a field of the script's config, e.g. --set train.lr=0.05 (repeatable)")
    _add_run_arguments(run, "the script's config, else runs/<script name>")
    _add_launch_arguments(run)
    run.set_defaults(handler=_run)
    run.epilog = "Arguments for the script go after --: ringtrain run train.py --nproc 2 -- --epochs 3"


def _add_run_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--run-dir", help=f"where the run writes its files (default: {default})")
    parser.add_argument("--resume", action="store_true", help="continue the run directory's latest valid checkpoint")
    parser.add_argument("--resume-from", metavar="PATH",
                        help="start a new run (an empty --run-dir) from this checkpoint, e.g. another run's")


def _add_launch_arguments(train: argparse.ArgumentParser) -> None:
    launch = train.add_argument_group("launch (as torchrun)")
    # Left out under srun or in a PyTorchJob, the scheduler's values fill these in (cluster.py).
    launch.add_argument("--nproc", type=int, help="workers on this node (default 1; PyTorchJob: PET_NPROC_PER_NODE)")
    launch.add_argument("--nnodes", help="nodes, N or MIN:MAX (default 1; under srun: SLURM_NNODES; "
                        "PyTorchJob: PET_NNODES or WORLD_SIZE); --nnodes 1 ignores the scheduler")
    launch.add_argument("--node-rank", type=int, help="this node's index; node 0 hosts the rendezvous (default 0; "
                        "under srun: SLURM_NODEID; PyTorchJob: PET_NODE_RANK or RANK)")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: a free port on 127.0.0.1; under "
                        "srun: the node list's first host, port 15000 + job id %% 20000; PyTorchJob: MASTER_ADDR:MASTER_PORT)")
    launch.add_argument("--local-addr", help="this node's address for worker sockets (default: loopback on one node; "
                        "node 0: the --rdzv-endpoint host; other nodes: their address that reaches it)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts after a worker failure (default 0)")
    launch.add_argument("--min-nproc", type=int,
                        help="elastic: the fewest workers on this node the job may shrink to (default: --nproc)")
    launch.add_argument("--heal", action="store_true",
                        help="with --min-nproc: a lost worker costs one redone step, not a restart: the others "
                             "regroup without it and go on ([dist] heal)")
    launch.add_argument("--rdzv-conf", default="", metavar="KEY=SECONDS,...",
                        help="rendezvous timing, e.g. last_call_timeout=5,keep_alive_interval=1 (as torchrun)")
    add_hostfile_arguments(train)


def _add_report(commands) -> None:
    report = commands.add_parser(
        "report", help="plots and a summary of where a run's time went",
        description="Turn RUN_DIR/metrics.jsonl into PNG plots and report.md; --compare explains scaling.",
    )
    report.add_argument("run_dir", help="a run directory written by `ringtrain train`")
    report.add_argument("--compare", metavar="OTHER_RUN_DIR", help="a second run to put side by side")
    report.add_argument("--out", help="output folder (default: RUN_DIR/report or RUN_DIR/report-vs-OTHER)")
    report.set_defaults(handler=_report)


def _add_config(commands) -> None:
    config = commands.add_parser(
        "config", help="print a resolved config, or every field with its documentation",
        description="With CONFIG: print it resolved (defaults filled in, overrides applied). Without: every field.",
    )
    _add_config_arguments(config, config_required=False)
    config.set_defaults(handler=_config)


def _launch_options(args: argparse.Namespace):
    from ringtrain.cluster import LaunchFlags, fill_launch_flags
    from ringtrain.group.env import cluster_environ
    from ringtrain.hostfile import check_hostfile_arguments, hostfile_flags, read_hostfile
    from ringtrain.launch import LaunchOptions

    # The one place a scheduler's allocation (SLURM under srun, a PyTorchJob) or a hostfile becomes launch flags.
    given = LaunchFlags(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    check_hostfile_arguments(args)
    if args.hostfile:
        args.hosts = read_hostfile(args.hostfile)
        filled = hostfile_flags(args.hosts, given, args.local_addr, args.rdzv_port, os.getpid())
    else:
        filled = fill_launch_flags(given, cluster_environ())
    flags = filled.flags
    options = LaunchOptions(
        nproc=flags.nproc,
        nnodes=flags.nnodes,
        node_rank=flags.node_rank,
        rdzv_endpoint=flags.rdzv_endpoint,
        local_addr=None if args.hostfile else args.local_addr,
        max_restarts=args.max_restarts,
        min_nproc=args.min_nproc,
        rdzv_conf=args.rdzv_conf,
        heal=args.heal,
        sigusr1_stops=filled.slurm,
    )
    options.validate()
    if filled.line:
        print(filled.line, file=sys.stderr, flush=True)
    return options


def _train(args: argparse.Namespace) -> int:
    # Imported here so `ringtrain --help` stays fast.
    from ringtrain.config import load_config, validate_for_backend, validate_for_world_sizes
    from ringtrain.data import check_data
    from ringtrain.group.init import resolve_backend
    from ringtrain.launch import Program
    from ringtrain.train.run import check_resume
    from ringtrain.train.user_parts import check_factories

    # Everything a user can get wrong is checked here, before any worker starts or any port opens.
    options = _launch_options(args)
    # --heal is the config's dist.heal too: checked with it here, and handed to the workers.
    overrides = [*args.overrides, *(["dist.heal=true"] if options.heal else [])]
    config = load_config(args.config, overrides, run_dir=args.run_dir)
    if config.user_parts:
        check_factories(config)  # imports and callability; what the factories return, rank 0 checks
    if config.dist.heal and not options.heal:  # the config asks for healing: the launcher must know too
        options = replace(options, heal=True)
        options.validate()
    # Every world size the job may run with (an elastic job shrinks and grows within the range).
    validate_for_world_sizes(config, *options.world_size_range())
    check_data(config.data)  # the files the config names
    validate_for_backend(config, resolve_backend(config.dist.backend))
    check_resume(config, args.resume, args.resume_from)

    # Absolute paths: an agent that joins later (ringtrain join) may start from another folder.
    worker_args = [str(Path(args.config).resolve()), "--run-dir", str(Path(config.run_dir).resolve())]
    for override in overrides:
        worker_args += ["--set", override]
    if args.resume:
        worker_args.append("--resume")
    if args.resume_from:
        worker_args += ["--resume-from", str(Path(args.resume_from).resolve())]
    if args.hostfile:
        return _launch_hosts(args, options, config.run_dir)
    _launch(options, Program.worker(worker_args), config.run_dir)
    print(f"run directory: {config.run_dir}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """`ringtrain run SCRIPT`: the script's ringtrain.fit() builds and checks its config on every worker; the
    launcher checks what it can know first: the flags, each override's key and value (against the schema), the
    run directory if named. What only the workers see (the script's config, its parts) they report, and the
    launcher prints it once (launch.py)."""
    import json

    from ringtrain.config import check_override_degrees, check_overrides
    from ringtrain.group.env import RESUME_VAR, RUN_DIR_VAR, SET_VAR, DistEnv
    from ringtrain.errors import ConfigError
    from ringtrain.launch import Program

    options = _launch_options(args)
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {args.script!r} not found; pass the Python file that calls ringtrain.fit()")
    check_overrides(args.overrides)
    # The layout's degrees the overrides set (else those of a RINGTRAIN_SET the workers inherit) against the
    # number of workers: what the launcher can know of the layout without the script's config.
    check_override_degrees(args.overrides or DistEnv.from_environ().overrides, *options.world_size_range())
    if args.resume and args.resume_from:
        raise ConfigError("pass --resume (continue this run) or --resume-from PATH (start a new run from PATH), not both")
    if options.per_worker_agents and not args.run_dir:
        raise ConfigError("ringtrain run with --min-nproc needs --run-dir: `ringtrain join RUN_DIR` finds the job there")
    script_args = args.script_args
    overrides = [*args.overrides, *(["dist.heal=true"] if options.heal else [])]
    env = {SET_VAR: json.dumps(overrides)} if overrides else {}
    if args.run_dir:
        env[RUN_DIR_VAR] = str(Path(args.run_dir).resolve())
        _check_script_run_dir(env[RUN_DIR_VAR], args.resume, args.resume_from)
    env[RESUME_VAR] = ("resume" if args.resume else f"from:{Path(args.resume_from).resolve()}" if args.resume_from
                       else "checked" if args.run_dir else "")
    run_dir = args.run_dir or str(Path("runs") / script.stem)
    if args.hostfile:
        return _launch_hosts(args, options, args.run_dir or "(as the script configures it)")
    _launch(options, Program.script(str(script.resolve()), script_args, env), run_dir)
    print(f"run directory: {args.run_dir or '(as the script configures it; default runs/' + script.stem + ')'}")
    return 0


def _check_script_run_dir(run_dir: str, resume: bool, resume_from: str | None) -> None:
    """--run-dir named: the same checks as `ringtrain train` makes, before any worker starts."""
    from ringtrain.config import Config
    from ringtrain.train.run import RUN_WORDS, check_resume

    check_resume(Config(run_dir=run_dir), resume, resume_from, RUN_WORDS)


def _launch_hosts(args: argparse.Namespace, options, run_dir: str) -> int:
    """--hostfile: the checked job, one launcher per host over ssh (hostfile.py); their exit code."""
    from ringtrain.group.auth import ensure_job_secret
    from ringtrain.group.env import remote_environ
    from ringtrain.hostfile import launch_hosts, node_argv

    # One secret for every host's launcher, handed to each over its ssh channel, never on a command line.
    ensure_job_secret(os.environ)
    argvs = [node_argv(args, args.hosts, i, options.rdzv_endpoint) for i in range(len(args.hosts.hosts))]
    code = launch_hosts(args.hosts, argvs, args.remote_python or sys.executable, args.remote_cwd or os.getcwd(),
                        remote_environ(), args.ssh_port, args.ssh_options)
    if code == 0:
        print(f"run directory: {run_dir}")
    return code


def _launch(options, program, run_dir: str) -> None:
    """One agent for the node's workers, or (elastic: --min-nproc below --nproc) one agent per worker."""
    from ringtrain.launch import launch

    log_dir = str(Path(run_dir) / "logs")
    if options.per_worker_agents:
        from ringtrain.elastic import launch_worker_agents

        launch_worker_agents(options, program, run_dir, log_dir)
    else:
        min_nodes, max_nodes = options.node_range()
        run_id = None
        if min_nodes < max_nodes and options.node_rank == 0:
            from ringtrain.elastic import write_job_file

            run_id = write_job_file(options, program, run_dir, log_dir)  # a host that lost the job rejoins with it
        try:
            launch(replace(options, log_dir=log_dir, run_id=options.run_id or run_id or ""), program)
        finally:
            if run_id is not None:
                from ringtrain.group.auth import forget_job_secret

                forget_job_secret(run_id)


def _report(args: argparse.Namespace) -> int:
    from ringtrain.monitor.report import load_run, write_report

    runs = [load_run(args.run_dir)]
    if args.compare:
        runs.append(load_run(args.compare))
    default_out = "report" if not args.compare else f"report-vs-{Path(args.compare).name}"
    report = write_report(runs, args.out or Path(args.run_dir) / default_out)
    print(report.read_text(), end="")
    print(f"report: {report} (plots beside it)")
    return 0


def _config(args: argparse.Namespace) -> int:
    from ringtrain.config import Config, load_config

    if args.config is None:
        print(_describe_fields(Config), end="")
        return 0
    print(load_config(args.config, args.overrides).to_toml(), end="")
    return 0


def _describe_fields(model, prefix: str = "") -> str:
    """Every field as 'section.field = default  # doc', from the config's own docstrings."""
    from pydantic import BaseModel

    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"\n[{name}]\n" + _describe_fields(annotation, prefix=f"{name}."))
            continue
        doc = " ".join((field.description or "").split())
        # A default_factory's value, not pydantic's PydanticUndefined placeholder (model.args = {}).
        default = field.get_default(call_default_factory=True)
        lines.append(f"{prefix}{field.alias or name} = {default!r}\n    {doc}\n")
    return "".join(lines)


def _add_fault_tolerance_tools(commands) -> None:
    join = commands.add_parser(
        "join", help="add a worker to a running elastic job",
        description="Start one more worker agent for the elastic job running in RUN_DIR (started with --min-nproc "
                    "below --nproc). It is admitted when the job next re-forms: at once, after the current step.",
    )
    join.add_argument("run_dir", nargs="?", help="the job's run directory (it holds job.json)")
    join.add_argument("--local-addr", help="this host's address for worker sockets (default: its address that "
                      "reaches the job's rendezvous)")
    join.add_argument("--spec", help=argparse.SUPPRESS)  # the job description inline (the launcher's own agents)
    join.set_defaults(handler=_join)

    ledger = commands.add_parser("ledger", help="check a run's sample ledger: every sample once per epoch",
                                 description="Read RUN_DIR/ledger.jsonl ([data] ledger = true) and count, per epoch, "
                                             "the samples used, duplicated and missing. Exit 1 on any violation.")
    ledger.add_argument("run_dir")
    ledger.set_defaults(handler=_ledger)

    diagnose = commands.add_parser(
        "diagnose", help="line up every rank's flight recorder: who is behind, who disagrees",
        description="Read RUN_DIR/flight/rank-R.json (written when a collective fails, or on SIGUSR1 to the "
                    "launcher) and say which rank is missing or behind, at which collective, and whether ranks "
                    "disagree about an operation or its size. Exit 1 when something is wrong.")
    diagnose.add_argument("run_dir")
    diagnose.set_defaults(handler=_diagnose)

    export = commands.add_parser("export", help="write a checkpoint's model weights as safetensors",
                                 description="Export the newest valid checkpoint (or --checkpoint) of RUN_DIR.")
    export.add_argument("run_dir")
    export.add_argument("--checkpoint", metavar="PATH", help="the checkpoint to export (default: the newest valid one)")
    export.add_argument("--out", metavar="FILE", help="output file (default: RUN_DIR/model.safetensors)")
    export.set_defaults(handler=_export)


def _join(args: argparse.Namespace) -> int:
    from ringtrain.elastic import JobSpec, join_job
    from ringtrain.errors import ConfigError

    if args.spec is None and args.run_dir is None:
        raise ConfigError("join needs the job's RUN_DIR, e.g. ringtrain join runs/digits_mlp")
    if args.spec:
        from ringtrain.group.lifetime import exit_with_parent

        # One of the launcher's own agents: it goes when the launcher (and its rendezvous store) goes.
        exit_with_parent()
    spec = JobSpec.from_json(args.spec) if args.spec else JobSpec.read(args.run_dir)
    if spec.heal and not args.spec:
        # `ringtrain train` and `ringtrain run SCRIPT` jobs alike: the worker (or the script's fit()) asks to
        # be admitted (its environment says it joins a --heal job).
        from ringtrain.elastic import join_healing_job

        join_healing_job(spec, args.local_addr)  # admitted at a step boundary, no rendezvous
        return 0
    join_job(spec, args.local_addr, launched_agent=args.spec is not None)
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from ringtrain.monitor.diagnose import diagnose, summary_line

    findings = diagnose(args.run_dir)
    print(summary_line(args.run_dir))
    for finding in findings:
        print(finding.text)
    return 0 if all(f.kind == "ok" for f in findings) else 1


def _ledger(args: argparse.Namespace) -> int:
    from ringtrain.data.ledger import LEDGER_FILE, check_ledger
    from ringtrain.errors import ConfigError

    path = Path(args.run_dir) / LEDGER_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: train with --set data.ledger=true to record one")
    try:
        reports = check_ledger(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for first, last, r in _epoch_ranges(reports):
        epochs = f"epoch {first}" if first == last else f"epochs {first}-{last}"
        sizes = " -> ".join(map(str, r.world_sizes))
        missing = f"{r.missing} missing" if r.complete else f"unfinished ({r.missing} not reached yet)"
        each = " each" if first != last else ""
        print(f"{epochs}: {r.used} sample uses{each}, {r.duplicates} duplicates, {missing}; world size {sizes}")
    duplicates = sum(r.duplicates for r in reports)
    missing = sum(r.missing for r in reports if r.complete)
    verdict = "every sample exactly once per epoch" if not duplicates and not missing else "NOT exactly once"
    print(f"{verdict}: {len(reports)} epochs, {duplicates} duplicates, {missing} missing")
    return 0 if all(r.exactly_once for r in reports) else 1


def _epoch_ranges(reports):
    """(first epoch, last epoch, report) for runs of consecutive epochs that read the same."""
    ranges: list = []
    for r in reports:
        same = ranges and (ranges[-1][2].used, ranges[-1][2].duplicates, ranges[-1][2].missing, ranges[-1][2].complete,
                           ranges[-1][2].world_sizes) == (r.used, r.duplicates, r.missing, r.complete, r.world_sizes)
        if same:
            ranges[-1][1] = r.epoch
        else:
            ranges.append([r.epoch, r.epoch, r])
    return ranges


def _export(args: argparse.Namespace) -> int:
    from ringtrain.checkpoint.export import export_model
    from ringtrain.checkpoint.manager import CheckpointManager
    from ringtrain.config import load_config

    from ringtrain.errors import ConfigError

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (it has no config.toml); pass the --run-dir of a run")
    config = load_config(run_dir / "config.toml", run_dir=str(run_dir))
    checkpoints = CheckpointManager(run_dir / config.checkpoint.dir, is_writer=False)
    out = Path(args.out) if args.out else run_dir / "model.safetensors"
    warn = lambda message: print(f"ringtrain: warning: {message}", file=sys.stderr)  # noqa: E731
    used = export_model(checkpoints, out, Path(args.checkpoint) if args.checkpoint else None, warn)
    print(f"wrote {out} from {used}")
    return 0


def entry() -> None:
    """The ``ringtrain`` command: ``main``, then a quick exit once torch is loaded (the interpreter's teardown
    of torch costs a launcher a third of a second after its workers are done; see group/lifetime.py)."""
    code = main()
    if "torch" in sys.modules:
        from ringtrain.group.lifetime import exit_quickly

        exit_quickly(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
