"""How much faster a 1024x1024 matmul runs on a worker's two compute threads than on one.

    flock -x /tmp/ringtrain-cpu.lock .venv/bin/python bench/threads_per_worker.py --repeats 50

A world of one worker brought up by ``init_distributed`` with ``dist.threads_per_worker = 2`` and pinning on, as
``ringtrain train`` does; then the best time of interleaved repeats with one and with two threads (noise only ever
slows a repeat down). With both threads held to one core, two are never faster than one. This was once a unit
test's assertion (two < 0.85 x one), which a loaded machine could not show; tests/comm/test_process_group.py now
asserts the pinning itself (the cores each compute thread may use), and the speed-up is measured here, alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringtrain.config import DistConfig  # noqa: E402 - after the repository is on the path
from ringtrain.group.env import DistEnv  # noqa: E402
from ringtrain.group.init import init_distributed  # noqa: E402


def matmul_s(a: torch.Tensor, threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    a @ a
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="interleaved repeats per thread count")
    parser.add_argument("--size", type=int, default=1024, help="side of the square matrix")
    args = parser.parse_args()
    with init_distributed(DistEnv(), DistConfig(backend="gloo", pin_cpu=True, threads_per_worker=2)):
        a = torch.randn(args.size, args.size)
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(args.repeats):
            for threads in (1, 2):
                best[threads] = min(best[threads], matmul_s(a, threads))
    print(json.dumps({"size": args.size, "one_thread_s": best[1], "two_threads_s": best[2],
                      "speed_up": best[1] / best[2]}))


if __name__ == "__main__":
    main()
