"""``ringtrain bench ...``: the benchmark subcommands (each writes JSON, a Markdown or CSV table, PNG plots).

    ringtrain bench collectives --nproc 2,4 --algorithms torch,ring,ring_chunked,shm --sizes 4K:64M --out DIR
    ringtrain bench train CONFIG --nproc 1,2 --strategies ddp,ddp:shm,manual --accum 1,4 --out DIR
    ringtrain bench checkpoint configs/text_lm.toml --nproc 2 --repeat 5 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ringtrain.errors import RingtrainError

__all__ = ["add_bench_parser"]


def add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="benchmarks: collectives, training (results written to files)",
        description="Benchmarks; each writes its results to --out.",
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_collectives(benchmarks)
    _add_train(benchmarks)
    _add_checkpoint(benchmarks)


def _add_collectives(benchmarks) -> None:
    collectives = benchmarks.add_parser(
        "collectives", help="all_reduce bandwidth: torch (Gloo) and ringtrain's algorithms, nccl-tests style",
        description="Time all_reduce of every size with every algorithm, in one run; print p50, algbw, busbw "
        "and the ratio to torch; write collectives.json, .csv and .png to --out.",
    )
    collectives.add_argument("--nproc", default="2", help="world sizes, comma-separated (default 2)")
    collectives.add_argument("--algorithms", default="torch,ring,ring_chunked,shm",
                             help="comma-separated: torch, ring, ring_chunked, shm, shm_inplace, deepspeed_shm, openmpi "
                             "(default: the first four)")
    collectives.add_argument("--ops", default="all_reduce",
                             help="collectives, comma-separated: all_reduce, all_gather, reduce_scatter, all_to_all, "
                             "broadcast, sendrecv, or all (default all_reduce); the ops other than all_reduce are timed "
                             "for torch (Gloo), shm (the ringtrain_shm c10d backend) and openmpi")
    collectives.add_argument("--sizes", default="4K:64M", help="MIN:MAX[:FACTOR] or a list, e.g. 4K:64M, 1M,16M (default 4K:64M)")
    collectives.add_argument("--out", default="bench-out", help="folder for collectives.json/.csv/.png (default bench-out)")
    collectives.add_argument("--iters", type=int, default=20, help="timed calls per point, at least (default 20)")
    collectives.add_argument("--dtype", default="float32", help="element type (default float32)")
    collectives.add_argument("--chunk-kb", type=int, help="ring_chunked's chunk in KiB (default: its measured default)")
    hosts = collectives.add_argument_group("across hosts (run on every host; --nproc is then the workers per host)")
    hosts.add_argument("--nnodes", type=int, default=1, help="hosts (default 1)")
    hosts.add_argument("--node-rank", type=int, default=0, help="this host's index; node 0 hosts the store and reports")
    hosts.add_argument("--rdzv-endpoint", help="HOST:PORT where node 0 hosts the workers' store, e.g. 198.18.0.1:29500")
    hosts.add_argument("--local-addr", help="this host's address for worker sockets (default: node 0: the endpoint's "
                       "host; other nodes: their address that reaches it)")
    collectives.set_defaults(handler=_bench_collectives)


def _add_train(benchmarks) -> None:
    train = benchmarks.add_parser(
        "train", help="throughput, scaling efficiency, exposed communication, overhead against bare DDP",
        description="Run `ringtrain train` and a bare PyTorch DDP loop for each (workers, strategy, accumulation).",
    )
    train.add_argument("config", help="TOML config file, e.g. configs/bench_resnet18.toml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override a config field (repeatable)")
    train.add_argument("--nproc", default="1,2", help="worker counts, comma separated (default 1,2)")
    train.add_argument("--strategies", default="ddp", help="STRATEGY[:ALGORITHM],... e.g. ddp,ddp:shm,manual; the "
                       "layouts tp (all workers one tensor-parallel group), tp+sp (the same with sequence parallelism), "
                       "fsdp+tp (tp pairs, FSDP2 across them), pp and ddp+pp split the built-in transformer")
    train.add_argument("--accum", default="1", help="gradient accumulation steps, comma separated (default 1)")
    train.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    train.add_argument("--interval", type=int, default=5, help="steps per timing interval (default 5)")
    train.add_argument("--repeat", type=int, default=1, help="runs of every case, taking turns (default 1)")
    train.add_argument("--out", default="bench-out/train", help="output folder (default bench-out/train)")
    train.add_argument("--no-bare", dest="bare", action="store_false",
                       help="skip the bare DDP loop (it runs the built-in image and digit workloads only, SGD)")
    train.set_defaults(handler=_bench_train)


def _add_checkpoint(benchmarks) -> None:
    checkpoint = benchmarks.add_parser(
        "checkpoint", help="sharded checkpoint saves: time blocked, synchronous against background",
        description="Save the config's model and AdamW state (FSDP2-sharded over --nproc workers) with the sharded "
                    "checkpointer, synchronously and in the background, --repeat times each; write checkpoint_bench.json.")
    checkpoint.add_argument("config", help="TOML config file, e.g. configs/text_lm.toml")
    checkpoint.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    checkpoint.add_argument("--repeat", type=int, default=5, help="saves of each kind (default 5)")
    checkpoint.add_argument("--out", default="bench-out/checkpoint", help="output folder (default bench-out/checkpoint)")
    checkpoint.set_defaults(handler=_bench_checkpoint)


def _bench_checkpoint(args: argparse.Namespace) -> int:
    from ringtrain.bench.checkpoint import run_checkpoint_bench
    from ringtrain.config import load_config

    load_config(args.config)  # a bad config is one line here, not a worker's traceback
    if args.nproc < 1 or args.repeat < 1:
        raise RingtrainError("--nproc and --repeat must be at least 1")
    result = run_checkpoint_bench(args.config, args.nproc, args.repeat, Path(args.out))
    print(f"sharded save of {args.config} ({result['world_size']} workers, {result['bytes_rank0'] / 1e6:.1f} MB on rank 0): "
          f"synchronous {result['sync_save_s'] * 1e3:.1f} ms, background {result['async_blocked_s'] * 1e3:.1f} ms blocked "
          f"+ {result['async_background_s'] * 1e3:.1f} ms behind training: blocked {result['blocked_ratio']:.1%} of the "
          f"synchronous save (medians of {result['repeat']})")
    print(f"results: {Path(args.out) / 'checkpoint_bench.json'}")
    return 0


def _bench_collectives(args: argparse.Namespace) -> int:
    from ringtrain.bench.options import BenchOptions, parse_ops, parse_sizes, parse_world_sizes

    options = BenchOptions(
        nprocs=parse_world_sizes(args.nproc),
        algorithms=tuple(a.strip() for a in args.algorithms.split(",") if a.strip()),
        sizes=parse_sizes(args.sizes),
        ops=parse_ops(args.ops),
        out=Path(args.out),
        iters=args.iters,
        dtype=args.dtype,
        chunk_kb=args.chunk_kb,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
    )
    options.validate()  # before torch is imported: mistakes are reported at once
    from ringtrain.bench.collectives import run_collectives_bench

    run_collectives_bench(options)
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    if args.steps < 3 * args.interval:
        raise RingtrainError(f"--steps ({args.steps}) must be at least 3 x --interval ({args.interval}): "
                             "the first interval is warm-up and a median needs more")
    from ringtrain.bench.training import parse_strategies, run_train_bench
    from ringtrain.bench.training_report import write_train_bench

    results = run_train_bench(
        args.config,
        nprocs=_int_list(args.nproc, "--nproc"),
        strategies=parse_strategies(args.strategies),
        accums=_int_list(args.accum, "--accum"),
        out_dir=Path(args.out),
        steps=args.steps,
        interval=args.interval,
        repeat=_int_list(str(args.repeat), "--repeat")[0],
        overrides=args.overrides,
        bare=args.bare,
    )
    print(write_train_bench(results, Path(args.out), "ringtrain " + " ".join(sys.argv[1:])), end="")
    print(f"results: {Path(args.out) / 'train_bench.json'} (Markdown table and plots beside it)")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RingtrainError(f"{flag} {text!r} is not a comma-separated list of whole numbers, e.g. 1,2") from None
    if not values or min(values) < 1:
        raise RingtrainError(f"{flag} {text!r} needs positive whole numbers, e.g. 1,2")
    return values
