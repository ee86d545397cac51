"""The cost of the job's secret (issue 39): a rendezvous through ringtrain's sealed backend against torch's own
c10d backend, launches alternated in one process, and one store round trip (set + get) sealed and plain.

    .venv/bin/python bench/rendezvous_cost.py --launches 20 --ops 2000

Each launch is ringtrain's launcher with 2 workers that exit at once; the time is the agent's
``next_rendezvous`` (torch's rendezvous handler). Prints medians (ms, us) and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler  # noqa: E402

from ringtrain.group import rendezvous  # noqa: E402
from ringtrain.group.auth import JobSecret  # noqa: E402
from ringtrain.group.auth_store import AuthStore  # noqa: E402
from ringtrain.launch import LaunchOptions, Program, launch  # noqa: E402


def rendezvous_times(launches: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"sealed (ringtrain-c10d)": [], "torch's c10d": []}
    current: list[str] = []
    first = DynamicRendezvousHandler.next_rendezvous

    def timed(self):
        start = time.perf_counter()
        try:
            return first(self)
        finally:
            times[current[0]].append(time.perf_counter() - start)

    DynamicRendezvousHandler.next_rendezvous = timed
    sealed_name = rendezvous.BACKEND
    for _ in range(launches):
        for name, backend in (("sealed (ringtrain-c10d)", sealed_name), ("torch's c10d", "c10d")):
            current[:] = [name]
            rendezvous.BACKEND = backend
            launch(LaunchOptions(nproc=2), Program(("-c", "pass")))
    rendezvous.BACKEND = sealed_name
    return times


def store_round_trips(ops: int) -> dict[str, list[float]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    plain = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    sealed = AuthStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)),
                       JobSecret.new(), "bench")
    value = b"x" * 200  # about a heartbeat or an address
    times: dict[str, list[float]] = {"sealed": [], "plain": []}
    for i in range(ops):
        for name, store in (("sealed", sealed), ("plain", plain)):
            start = time.perf_counter()
            store.set(f"{name}/{i}", value)
            store.get(f"{name}/{i}")
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    ops = store_round_trips(args.ops)
    sealed, plain = statistics.median(ops["sealed"]) * 1e6, statistics.median(ops["plain"]) * 1e6
    print(f"store set+get, median of {args.ops}: sealed {sealed:.0f} us, plain {plain:.0f} us ({sealed / plain:.2f}x)")
    times = rendezvous_times(args.launches)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, t in times.items():
        print(f"rendezvous {name}, median of {len(t)}: {medians[name]:.0f} ms (min {min(t) * 1e3:.0f}, "
              f"max {max(t) * 1e3:.0f})")
    ratio = medians["sealed (ringtrain-c10d)"] / medians["torch's c10d"]
    print(f"sealed / torch's: {ratio:.2f}x")


if __name__ == "__main__":
    main()
