"""The per-process entry point: one training worker.

Started by ``ringtrain train`` through torch's elastic agent, or directly by plain torchrun::

    torchrun --nproc-per-node 2 -m ringtrain.worker configs/digits_mlp.toml
"""

from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ringtrain.config import load_config, validate_for_world_size
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import init_distributed
from ringtrain.errors import RingtrainError
from ringtrain.train.run import check_run_dir, run_training

__all__ = ["main", "build_worker_parser"]


def build_worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.worker", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable)")
    parser.add_argument("--run-dir", help="run directory (default: runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    return parser


@record
def main(argv: list[str] | None = None) -> None:
    args = build_worker_parser().parse_args(argv)
    env = DistEnv.from_environ()
    try:
        config = load_config(args.config, args.overrides, run_dir=args.run_dir)
        validate_for_world_size(config, env.world_size)
        # After an elastic restart the job continues from its own last checkpoint.
        resume = args.resume or env.is_restart
        check_run_dir(config, resume)
        with init_distributed(env, config.dist) as ctx:
            run_training(config, ctx, resume=resume, resume_required=args.resume and not env.is_restart)
    except RingtrainError as err:
        # The launcher reports the first failed rank with this message; plain torchrun shows it too.
        ErrorHandler().record_exception(err)
        if not env.launched_by_ringtrain:
            print(f"ringtrain: error: [rank {env.rank}] {err}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
