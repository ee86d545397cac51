"""The native shm all-reduce's staged calls per piece size, with the time per phase (``profile_stats``).

    PIECES=0.25,0.5,1,2,4 .venv/bin/python bench/shm_pieces.py --nproc 4

``--nproc`` ranks (pinned round robin to the cores, as ringtrain's workers are) in one fresh launch; for
each piece size (MiB, the ``PIECES`` environment variable, default 1,2,4; the native default is
``NATIVE_PIECE_BYTES``) and message size, the median of ``--calls`` calls (max over ranks, ms) and, per
call on rank 0, the futex sleeps and the seconds spent waiting, copying in, reducing and gathering. Two
rounds over the piece sizes, so that a change of the machine's state shows as a difference between rounds.
Run it under ``flock -x /tmp/ringtrain-cpu.lock`` like every timing here, and ``bench/core_distance.c``
beside it to know the core placement (see docs/benchmarks.md, Round 3).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shm_stores import median_s, start_native  # noqa: E402 - the timing and set-up it shares

SIZES = (16 << 20, 64 << 20)


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    native = start_native(rank, port, args.nproc)
    tensors = {size: torch.zeros(size // 4) for size in SIZES}
    lines = []
    for round_ in range(2):
        for piece in args.pieces:
            native.piece_bytes = piece
            for size, tensor in tensors.items():
                native.reset_profile()
                native.profile = True
                ms = median_s(tensor, args.calls) * 1e3
                native.profile = False
                s = native.profile_stats()
                per_call = {k: s[k] / s["calls"] * 1e3 for k in ("wait_s", "copy_in_s", "reduce_s", "gather_s")}
                lines.append(f"round {round_} piece {piece >> 10}K {size >> 20}M {ms:.2f} ms | per call on rank 0: "
                             f"sleeps {s['sleeps'] / s['calls']:.1f}, ms wait {per_call['wait_s']:.2f} copy_in "
                             f"{per_call['copy_in_s']:.2f} reduce {per_call['reduce_s']:.2f} gather {per_call['gather_s']:.2f}")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks, pinned round robin to the cores")
    parser.add_argument("--calls", type=int, default=11, help="timed calls per piece and message size (the median)")
    args = parser.parse_args()
    args.pieces = [int(float(p) * (1 << 20)) for p in os.environ.get("PIECES", "1,2,4").split(",")]
    mp.spawn(_worker, args=(29400 + os.getpid() % 500, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
