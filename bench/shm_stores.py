"""The native shm all-reduce's staged calls with plain, streaming and adaptive stores, sampled over time.

    .venv/bin/python bench/shm_stores.py --samples 12 --period 5 --sizes 64K,1M,4M,16M,64M

``--nproc`` ranks (2: one per core; pinned round robin) stay up for the whole run, so that what changes between samples is the machine,
not the processes or their memory. Every ``--period`` seconds, holding the exclusive CPU lock
(``/tmp/ringtrain-cpu.lock``, as every timing here does), one sample: the distance between the two cores
(``bench/core_distance.c``: the shortest cache-line round trip, ns; built with ``cc`` if there is one),
then per size the median of ``--calls`` calls (max over ranks, µs) with ``stream_mode`` 2 (adaptive: the default),
0 (plain stores) and 1 (streaming stores), in that order. One line per sample on stdout. On the 2-vCPU
VM the distance flips between ~50 ns (one die) and ~270-400 ns (two) every few seconds to minutes, and
the plain stores' speed with it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringtrain import comm  # noqa: E402 - the repository's own package
from ringtrain.comm.shm_group import get_shm_group  # noqa: E402

LOCK = "/tmp/ringtrain-cpu.lock"
MODES = {"adapt": 2, "plain": 0, "stream": 1}


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _core_distance() -> str | None:
    """Build bench/core_distance.c once; the path of the program, or None without a compiler."""
    program = os.path.join(tempfile.gettempdir(), f"ringtrain-core-distance-{os.getuid()}")
    result = subprocess.run(["cc", "-O2", "-pthread", str(REPO / "bench" / "core_distance.c"), "-o", program],
                            capture_output=True, text=True)
    return program if result.returncode == 0 else None


def median_s(tensor: torch.Tensor, calls: int) -> float:
    """Median seconds of ``calls`` shm all-reduces of ``tensor`` (max over ranks), after one warm-up call.
    Collective. Shared with bench/shm_pieces.py."""
    dist.barrier()
    comm.all_reduce(tensor, algorithm="shm")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        comm.all_reduce(tensor, algorithm="shm")
        times.append(time.perf_counter() - start)
    times = torch.tensor(times)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median())


def start_native(rank: int, port: int, nproc: int):
    """This rank pinned (round robin) in a Gloo group of ``nproc`` on loopback; the group's native shm
    workspace, or SystemExit with the reason when it is not built. Shared with bench/shm_pieces.py."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    comm.all_reduce(torch.ones(8), algorithm="shm")
    native = get_shm_group(dist.group.WORLD).native
    if native is None:
        raise SystemExit("the native shm all-reduce is not available here (see `python -m ringtrain.comm.shm_native`)")
    return native


def _worker(rank: int, port: int, args: argparse.Namespace, program: str | None) -> None:
    native = start_native(rank, port, args.nproc)
    tensors = {size: torch.zeros(size // 4) for size in args.sizes}
    lock = open(LOCK, "a") if rank == 0 else None
    for _ in range(args.samples):
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        dist.barrier()
        line = [time.strftime("%H:%M:%S")]
        if rank == 0 and program is not None:
            line.append(f"cores {subprocess.run([program], capture_output=True, text=True).stdout.strip()} ns")
        dist.barrier()
        for size, tensor in tensors.items():
            times = {}
            for name, mode in MODES.items():
                native.stream_mode = mode
                times[name] = median_s(tensor, args.calls) * 1e6
            native.stream_mode = MODES["adapt"]
            line.append(f"{size >> 10}K " + " ".join(f"{name} {us:.1f}" for name, us in times.items()))
        dist.barrier()
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            print(" | ".join(line), flush=True)
        time.sleep(args.period)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks, pinned round robin to the cores")
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--period", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--sizes", default="64K,1M,4M,16M,64M", help="message sizes, comma-separated (K, M)")
    parser.add_argument("--calls", type=int, default=7, help="timed calls per size and kind of store (the median)")
    args = parser.parse_args()
    args.sizes = [_bytes(size) for size in args.sizes.split(",")]
    program = _core_distance()
    if program is None:
        print("bench/shm_stores.py: no C compiler (cc): the core distance is left out", file=sys.stderr)
    mp.spawn(_worker, args=(29400 + os.getpid() % 500, args, program), nprocs=args.nproc)


if __name__ == "__main__":
    main()
