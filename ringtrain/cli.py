"""The ``ringtrain`` command: argv in, a launched job or a report out; no training logic here.

    ringtrain train configs/digits_mlp.toml --nproc 2 [--run-dir runs/x] [--set train.lr=0.1] [--resume]
    ringtrain config [configs/digits_mlp.toml] [--set ...]   # the resolved config, or every field documented
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ringtrain.errors import RingtrainError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringtrain", description="Distributed data-parallel training for PyTorch, and why it is fast or slow."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(commands)
    _add_config(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    train.add_argument("--run-dir", help="where the run writes its files (default: runs/<config name>)")
    train.add_argument("--resume", action="store_true", help="continue the run directory's latest checkpoint")
    launch = train.add_argument_group("launch (as torchrun)")
    launch.add_argument("--nproc", type=int, default=1, help="workers on this node (default 1)")
    launch.add_argument("--nnodes", default="1", help="nodes, N or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 hosts the rendezvous")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: a free port on 127.0.0.1)")
    launch.add_argument("--local-addr", help="this node's address for worker sockets (default: loopback)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts after a worker failure (default 0)")
    train.set_defaults(handler=_train)


def _add_config(commands) -> None:
    config = commands.add_parser(
        "config", help="print a resolved config, or every field with its documentation",
        description="With CONFIG: print it resolved (defaults filled in, overrides applied). Without: every field.",
    )
    _add_config_arguments(config, config_required=False)
    config.set_defaults(handler=_config)


def _train(args: argparse.Namespace) -> int:
    # Imported here so `ringtrain --help` stays fast.
    from ringtrain.config import load_config, validate_for_backend, validate_for_world_size
    from ringtrain.dist.group import resolve_backend
    from ringtrain.launch import LaunchOptions, launch
    from ringtrain.train.run import check_run_dir

    options = LaunchOptions(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
        max_restarts=args.max_restarts,
    )
    # Everything a user can get wrong is checked here, before any worker starts or any port opens.
    options.validate()
    config = load_config(args.config, args.overrides, run_dir=args.run_dir)
    min_nodes, max_nodes = options.node_range()
    for nodes in range(min_nodes, max_nodes + 1):
        validate_for_world_size(config, nodes * options.nproc)
    validate_for_backend(config, resolve_backend(config.dist.backend))
    check_run_dir(config, args.resume)

    worker_args = [args.config, "--run-dir", config.run_dir]
    for override in args.overrides:
        worker_args += ["--set", override]
    if args.resume:
        worker_args.append("--resume")
    launch(replace(options, log_dir=str(Path(config.run_dir) / "logs")), worker_args)
    print(f"run directory: {config.run_dir}")
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
        lines.append(f"{prefix}{name} = {field.default!r}\n    {doc}\n")
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
